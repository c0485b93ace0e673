"""Sessions: an agent's conversation keeps its KV in RAM between turns.

An agent's turn ends, it calls a tool, and a few seconds later its next turn sends the same conversation
plus the tool's result. Meanwhile the other agents' prompts fill the prefix cache, and plain LRU may evict
the conversation just before it is needed again. A request that names its session (``Engine.submit(...,
session=)``; LangChain's ``thread_id``; the server's ``user``, ``x-session-id`` or Anthropic
``metadata.user_id``) pins its context in the radix tree when it finishes, for ``ttl_s`` seconds: pinned
entries are never evicted, so the next turn finds them. The next turn's own finish moves the pin to its
longer context; :meth:`release` (``Engine.release_session``) or the TTL frees it, after which the entry is an
ordinary one (evicted least recently used). Pins are bounded: they hold at most ``max_bytes`` (a share of the
KV budget), so the running rows always keep the rest; they give way when the running rows need the room (before
any row is preempted) and when a request waits with nothing running to make room for it: sessions never
starve admission.

Which pin gives way: the one kept last. A tool call takes a bounded time, so the agent that has waited longest
is the likeliest to come back next; dropping the oldest pin (as least-recently-used eviction would) drops the
context just before it pays. So a pin, once kept, lasts until its next turn, its TTL or its release, and a
turn that ends when the pins are full is not kept (its context stays an ordinary cache entry).

A session names a pin only: sessions of different callers never see each other's data (the prefix cache is
shared by content anyway); a name reused by two conversations keeps the later one warm.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

#: Seconds a finished turn's context stays pinned where sessions are turned on (``Engine(session_ttl=)``): a
#: tool call's time. The engine's default is 0 (off).
DEFAULT_TTL_S = 30.0
#: The share of the KV budget sessions may pin (the running rows keep the rest: preemption and admission
#: count pinned bytes as taken). Half: under memory pressure the rows keep room for a few turns at once (on
#: a CPU a decode step of one row costs nearly what one of several does).
DEFAULT_SHARE = 0.5


@dataclass
class _Pin:
    node: object  # the radix node at the end of the context (pinned with its path)
    expires: float


def _is_ancestor(node, of) -> bool:
    """``node`` is ``of`` or on its path to the root (a pinned node stays in the tree: splits keep it the lower
    part)."""
    while of is not None:
        if of is node:
            return True
        of = of.parent
    return False


class SessionPins:
    def __init__(self, radix, ttl_s: float, max_bytes: int, bytes_per_token: int = 0):
        self.radix = radix
        self.bytes_per_token = bytes_per_token
        self.ttl_s = float(ttl_s)
        self.max_bytes = int(max_bytes)
        self.pins: dict[str, _Pin] = {}
        self.kept = self.expired = self.released = self.displaced = 0

    @property
    def nbytes(self) -> int:
        """KV the pins hold, each node once: sessions share their system prompt and tool schemas."""
        seen: set[int] = set()
        tokens = 0
        for pin in self.pins.values():
            node = pin.node
            while node is not None and node.parent is not None and id(node) not in seen:
                seen.add(id(node))
                tokens += len(node.tokens)
                node = node.parent
        return tokens * self.bytes_per_token

    def keep(self, session: str, tokens: list[int], ns) -> None:
        """A turn of ``session`` ended with ``tokens`` in the tree: pin them (replacing its last pin)."""
        if self.ttl_s <= 0 or self.max_bytes <= 0:
            return
        match = self.radix.match(tokens, record=False, ns=ns)
        old = self.pins.pop(session, None)
        expires = time.monotonic() + self.ttl_s
        if match.length:
            self.radix.pin(match.node)
            self.pins[session] = _Pin(match.node, expires)
            self.kept += 1
        if old is not None:
            if match.length and self.nbytes > self.max_bytes and _is_ancestor(old.node, match.node):
                # No room for the longer context: the session keeps the one it had (its next turn then
                # recomputes only what this turn added), rather than letting go of all of it.
                self.radix.unpin(match.node)
                self.pins[session] = _Pin(old.node, expires)
            else:
                self.radix.unpin(old.node)
        self.bound()

    def bound(self) -> None:
        """Within ``max_bytes``: the pins kept last let go first (see the module docstring)."""
        for session, _ in sorted(self.pins.items(), key=lambda kv: -kv[1].expires):
            if self.nbytes <= self.max_bytes:
                break
            self._drop(session)
            self.displaced += 1

    def give_way(self, keep: str | None = None) -> bool:
        """Memory is short (rows to run, a request to admit): the pin kept last, other than ``keep``'s, lets
        go. False when there is none."""
        others = [(p.expires, s) for s, p in self.pins.items() if s != keep]
        if not others:
            return False
        self._drop(max(others)[1])
        self.displaced += 1
        return True

    def expire(self, now: float | None = None, waiting=()) -> int:
        """Let go of the pins whose time is up, but not those of the sessions in ``waiting`` (their next turn
        is queued: on a busy engine it may wait longer than the TTL, and it is the turn the pin is for);
        returns how many."""
        now = time.monotonic() if now is None else now
        done = [s for s, p in self.pins.items() if p.expires <= now and s not in waiting]
        for s in done:
            self._drop(s)
        self.expired += len(done)
        return len(done)

    def release(self, session: str | None = None) -> int:
        """Let go of ``session``'s pin now (None: every session's); returns how many."""
        names = list(self.pins) if session is None else [session] if session in self.pins else []
        for s in names:
            self._drop(s)
        self.released += len(names)
        return len(names)

    def _drop(self, session: str) -> None:
        pin = self.pins.pop(session)
        self.radix.unpin(pin.node)

    def stats(self) -> dict:
        return {"sessions_pinned": len(self.pins), "sessions_pinned_bytes": self.nbytes,
                "sessions_kept": self.kept, "sessions_expired": self.expired,
                "sessions_released": self.released, "sessions_displaced": self.displaced}
