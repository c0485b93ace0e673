"""Which replica a request goes to, for ``parallm serve --ray`` (:mod:`parallm_engine.serve.ray_serve`): plain
Python, no Ray, so the policy is tested on its own and the Ray router (:mod:`~parallm_engine.serve.ray_router`)
stays a thin adapter.

The front reads each request once: its **routing key** is the chain of hashes of fixed-size blocks of the
request's prompt-shaping fields (tools, system / instructions, then the messages / prompt / input, as JSON, in
order), so a conversation's next turn, whose body repeats the earlier turn's and adds to it, shares all but the
last block with it, and agents over one system prompt share its blocks. Each replica has a
:class:`PrefixRecord`: the blocks of the prompts recently routed to it, least recently used dropped past a
bound (the same approximation as Ray Serve LLM's ``PrefixCacheAffinityRouter`` and SGLang's ``cache_aware``
router: what was sent there, not what its radix cache still holds). :meth:`RoutingTable.choose` picks:

1. a request naming a replica (``target``: the front asking each replica for its metrics, a stored response)
   goes there;
2. a request naming a session (:mod:`~parallm_engine.serve.request_identity`: ``x-session-id``, an agent's ids) goes to the
   replica its session went to before;
3. otherwise to the replica holding the longest prefix of its key (at least ``min_match_blocks``; ties: the
   least loaded);
4. otherwise, and whenever the replica 2 or 3 chose carries too many requests in flight above the least loaded
   replica, to the least loaded one (ties: the smallest record, so new prefixes spread). The session is then
   pinned to the new replica. Too many: more than ``slack`` (default 4) for a request that shares only part of
   an earlier prompt with the replica (a new conversation over a shared system prompt: moving it costs that
   part's prefill once), more than ``4 x slack`` for a session or a request that extends a whole earlier prompt
   sent there (a conversation's next turn: moving it costs its whole history's prefill).

Bounded imbalance: affinity never sends a request to a replica carrying more than ``4 x slack`` (16) in-flight
requests above the least loaded one, new conversations not above ``slack``; so by affinity alone the busiest
and the idlest replica differ by at most ``4 x slack + 1`` requests in flight (and Ray Serve skips a replica at
``max_ongoing_requests``).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from parallm_engine.serve.request_identity import request_session

#: Bytes of the routing text per block: ~16 tokens of English, ~10 token ids as JSON. Small, so a new
#: conversation's own question (after a shared system prompt) fills a block of its own: that is how a next turn
#: (which extends a whole earlier prompt) is told from a new conversation (which shares only part of one).
BLOCK_BYTES = 64
#: In-flight requests a replica may carry above the least loaded one and still win by affinity, for a request
#: that shares only part of its prefix with it (a new conversation over a shared system prompt) ...
DEFAULT_SLACK = 4
#: ... and, times this, for a conversation's next turn (it extends a whole prompt sent there) or a session's request.
STRONG_SLACK_FACTOR = 4
#: Blocks a replica must hold of a key to win by prefix (4 blocks: ~64 tokens).
DEFAULT_MIN_MATCH_BLOCKS = 4
#: Blocks remembered per replica (x 64 bytes: ~12 MB of prompt text, about what a replica's KV holds).
DEFAULT_RECORD_BLOCKS = 200_000
#: Sessions (and stored responses) remembered, least recently used dropped first.
DEFAULT_SESSIONS = 100_000

POLICIES = ("prefix", "round_robin")
#: The routing table of each replica deployment this process routes to, by (app, deployment): the router
#: registers it, the front reads it for ``/metrics`` and ``/replicas``.
TABLES: dict[tuple[str, str], "RoutingTable"] = {}
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp[-_][A-Za-z0-9]+)"')


@dataclass
class ForwardedRequest:
    """One HTTP request as the front hands it to a replica (the replica runs it through ``parallm serve``'s own
    app), with what the router reads: the key's block hashes, the session, a replica it must go to."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    blocks: list[int] = field(default_factory=list)
    session: str | None = None
    target: str | None = None  # a replica's id: this request must run there


def _prompt_parts(path: str, body: dict) -> list[Any]:
    """The fields that make a request's prompt, in the order the chat template renders them."""
    if path == "/v1/completions":
        return [body.get("prompt")]
    if path == "/v1/messages":
        return [body.get("tools"), body.get("system"), *(body.get("messages") or [])]
    if path == "/v1/responses":
        items = body.get("input")
        return [body.get("tools"), body.get("instructions"), *(items if isinstance(items, list) else [items])]
    return [body.get("tools"), *(body.get("messages") or [])]  # chat completions (and anything else)


def block_hashes(parts: Sequence[Any], block_bytes: int = BLOCK_BYTES) -> list[int]:
    """Chain hashes of the full ``block_bytes`` blocks of the parts' JSON: block i's hash covers blocks 0..i,
    so two keys share a hash only where they share the whole prefix up to it (vLLM's block hashing)."""
    text = b"".join(json.dumps(p, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()
                    for p in parts if p is not None)
    out, prev = [], b""
    for start in range(0, len(text) - block_bytes + 1, block_bytes):
        prev = hashlib.blake2b(prev + text[start:start + block_bytes], digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


def session_of(headers: dict[str, str], body: dict) -> str | None:
    """The session a request names: the server's own rule (:func:`request_identity.request_session`), so a
    session's turns go to the replica that pins its context."""
    return request_session(headers, body)


def stored_response_id(path: str, body: dict) -> str | None:
    """The stored response a Responses API request reads: it lives on the replica that made it."""
    if path.startswith("/v1/responses/"):
        return path[len("/v1/responses/"):].split("/")[0] or None
    prev = body.get("previous_response_id") if path == "/v1/responses" else None
    return str(prev) if prev else None


def response_ids(chunk: bytes) -> list[str]:
    """Response ids in a ``/v1/responses`` answer's first bytes (its JSON body, or the ``response.created``
    event), so later requests that name them go to this replica."""
    return [m.decode() for m in _RESPONSE_ID.findall(chunk)]


def routing_fields(path: str, headers: dict[str, str], raw_body: bytes) -> tuple[list[int], str | None, str | None]:
    """A request's block hashes, session and stored response id, from its path, headers and body. A body that
    is not a JSON object routes by load alone (the replica answers its error)."""
    try:
        body = json.loads(raw_body) if raw_body else {}
    except (ValueError, UnicodeDecodeError):
        body = {}
    if not isinstance(body, dict):
        body = {}
    try:
        blocks = block_hashes(_prompt_parts(path, body))
    except (TypeError, ValueError):  # not JSON-serialisable after all: no prefix
        blocks = []
    return blocks, session_of(headers, body), stored_response_id(path, body)


class LRU:
    """A bounded map, least recently used entry dropped first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict = OrderedDict()

    def get(self, key, default=None):
        value = self._items.get(key, default)
        if key in self._items:
            self._items.move_to_end(key)
        return value

    def put(self, key, value=None) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def pop(self, key, default=None):
        return self._items.pop(key, default)

    def __contains__(self, key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def drop_values(self, value) -> None:
        for key in [k for k, v in self._items.items() if v == value]:
            del self._items[key]


class PrefixRecord(LRU):
    """The blocks of the prompts recently routed to one replica, and where each prompt ended."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.ends = LRU(max(1024, capacity // 16))  # the last block of each prompt routed here

    def continues(self, blocks: Sequence[int], matched: int) -> bool:
        """Whether the held part of ``blocks`` covers a whole earlier prompt sent here: a conversation's next
        turn (its history is there), not a new one that shares a system prompt."""
        return any(h in self.ends for h in blocks[:matched])

    def matched(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of ``blocks`` this replica holds (blocks are chained: stop at the first miss)."""
        n = 0
        for h in blocks:
            if h not in self._items:
                break
            n += 1
        return n

    def add(self, blocks: Sequence[int]) -> None:
        for h in blocks:
            self.put(h)
        if blocks:
            self.ends.put(blocks[-1])


@dataclass
class Choice:
    """The replicas to try, best first (Ray takes the least loaded of a rank that is not full), and why."""

    ranks: list[list[str]]
    reason: str  # target / session / prefix / overflow / least_loaded / round_robin


class RoutingTable:
    """The state :meth:`choose` reads and :meth:`routed` updates: per replica its record and requests in flight,
    the sessions' replicas, and how many requests went where and why."""

    def __init__(self, policy: str = "prefix", slack: int = DEFAULT_SLACK,
                 min_match_blocks: int = DEFAULT_MIN_MATCH_BLOCKS, record_blocks: int = DEFAULT_RECORD_BLOCKS,
                 sessions: int = DEFAULT_SESSIONS):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        self.policy, self.slack, self.min_match_blocks = policy, slack, min_match_blocks
        self.record_blocks = record_blocks
        self.records: dict[str, PrefixRecord] = {}
        self.in_flight: dict[str, int] = {}
        self.sessions = LRU(sessions)
        self.decisions: dict[tuple[str, str], int] = {}  # (replica, reason) -> requests
        self._pending: dict[str, str] = {}  # request id -> the replica chosen, until Ray has sent it
        self._turn = 0
        # Ray's router loop updates the table; the front's /metrics and /replicas read it from another thread.
        self.lock = threading.Lock()

    def set_replicas(self, replicas: Sequence[str]) -> None:
        """The live replicas; a replica gone takes its record and its sessions with it."""
        with self.lock:
            self._set_replicas(replicas)

    def _set_replicas(self, replicas: Sequence[str]) -> None:
        live = set(replicas)
        for r in live - set(self.records):
            self.records[r] = PrefixRecord(self.record_blocks)
            self.in_flight.setdefault(r, 0)
        for r in set(self.records) - live:
            del self.records[r]
            self.in_flight.pop(r, None)
            self.sessions.drop_values(r)

    def choose(self, replicas: Sequence[str], req: ForwardedRequest | None, request_id: str | None = None) -> Choice:
        """Where ``req`` should go. The choice counts at once (its blocks, its session, a request in flight
        there), so requests arriving together, before the first is sent, see it (a session's requests, agents
        over one system prompt); :meth:`routed` moves it if Ray sends the request elsewhere."""
        with self.lock:
            if request_id is not None and request_id in self._pending:  # chosen again (Ray's retry loop)
                self._count(self._pending.pop(request_id), -1)
            choice = self._choose(replicas, req)
            if choice.ranks and len(choice.ranks[0]) == 1:
                replica = choice.ranks[0][0]
                if req is not None:
                    self._claim(replica, req)
                if request_id is not None:
                    self._pending[request_id] = replica
                    self._count(replica, +1)
            return choice

    def _count(self, replica: str, delta: int) -> None:
        if replica in self.in_flight:
            self.in_flight[replica] = max(0, self.in_flight[replica] + delta)

    def _choose(self, replicas: Sequence[str], req: ForwardedRequest | None) -> Choice:
        self._set_replicas(replicas)
        if not replicas:
            return Choice([], "none")
        by_load = sorted(replicas, key=lambda r: (self.in_flight.get(r, 0), len(self.records[r]), r))
        if req is not None and req.target is not None:  # gone: any replica answers (a 404 for a lost response)
            return Choice([[req.target]], "target") if req.target in self.records else Choice([by_load], "target_gone")
        if self.policy == "round_robin":
            ordered = sorted(replicas)
            self._turn += 1
            return Choice([[ordered[self._turn % len(ordered)]]], "round_robin")
        if req is None:
            return Choice([by_load[:1], by_load[1:]], "least_loaded")
        least = self.in_flight.get(by_load[0], 0)

        def preferring(r: str, reason: str, strong: bool) -> Choice:
            if self.in_flight.get(r, 0) <= least + self.slack * (STRONG_SLACK_FACTOR if strong else 1):
                return Choice([[r], [x for x in by_load if x != r]], reason)
            return Choice([by_load[:1], by_load[1:]], "overflow")

        pinned = self.sessions.get(req.session) if req.session else None
        if pinned in self.records:
            return preferring(pinned, "session", strong=True)
        if req.blocks:
            matched = {r: self.records[r].matched(req.blocks) for r in replicas}
            best = max(matched.values())
            if best >= self.min_match_blocks:
                holder = next(r for r in by_load if matched[r] == best)  # the least loaded of the longest
                # A conversation's next turn: moving it would prefill its whole history elsewhere.
                return preferring(holder, "prefix", strong=self.records[holder].continues(req.blocks, best))
        return Choice([by_load[:1], by_load[1:]], "least_loaded")

    def routed(self, replica: str, req: ForwardedRequest | None, reason: str, request_id: str | None = None) -> None:
        """``req`` was sent to ``replica``: it holds the request's prefix now, and its session."""
        with self.lock:
            self._routed(replica, req, reason, request_id)

    def _routed(self, replica: str, req: ForwardedRequest | None, reason: str, request_id: str | None) -> None:
        claimed = self._pending.pop(request_id, None) if request_id is not None else None
        if claimed != replica:
            if claimed is not None:
                self._count(claimed, -1)
            self._count(replica, +1)
        self.decisions[(replica, reason)] = self.decisions.get((replica, reason), 0) + 1
        if req is not None:
            self._claim(replica, req)

    def _claim(self, replica: str, req: ForwardedRequest) -> None:
        record = self.records.get(replica)
        if record is None or req.target is not None:
            return
        record.add(req.blocks)
        if req.session:
            self.sessions.put(req.session, replica)

    def completed(self, replica: str) -> None:
        with self.lock:
            if self.in_flight.get(replica, 0) > 0:
                self.in_flight[replica] -= 1

    def snapshot(self) -> dict:
        with self.lock:
            return self._snapshot()

    def _snapshot(self) -> dict:
        return {"policy": self.policy, "slack": self.slack,
                "replicas": {r: {"in_flight": self.in_flight.get(r, 0), "record_blocks": len(rec)}
                             for r, rec in self.records.items()},
                "sessions": len(self.sessions),
                "decisions": [{"replica": r, "reason": why, "requests": n}
                              for (r, why), n in sorted(self.decisions.items())]}
