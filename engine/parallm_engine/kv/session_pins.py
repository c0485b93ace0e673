"""Sessions: an agent's conversation keeps its KV in RAM between turns.

An agent's turn ends, it calls a tool, and a few seconds later its next turn sends the same conversation
plus the tool's result. Meanwhile the other agents' prompts fill the prefix cache, and plain LRU may evict
the conversation just before it is needed again. A request that names its session (``Engine.submit(...,
session=)``; LangChain's ``thread_id``; the server's ``user``, ``x-session-id`` or Anthropic
``metadata.user_id``) pins its context in the radix tree when it finishes, for ``ttl_s`` seconds: pinned
entries are never evicted, so the next turn finds them. The next turn's own finish moves the pin to its
longer context; :meth:`release` (``Engine.release_session``) or the TTL frees it, after which the entry is an
ordinary one (evicted least recently used). Pins are bounded: they hold at most ``max_bytes`` (a share of the
KV budget), so the running rows always keep the rest; they give way when the running rows need the room, before
any row is preempted where that spares every preemption (``PagedKVManager.yield_sessions_to_rows``), and when a
request waits with nothing running to make room for it: sessions never starve admission. A pin gives way only
where that frees memory now (one over pages a running row holds frees nothing).

Which pin gives way: the one kept last. A tool call takes a bounded time, so the agent that has waited longest
is the likeliest to come back next; dropping the oldest pin (as least-recently-used eviction would) drops the
context just before it pays. So a pin, once kept, lasts until its next turn, its TTL or its release, and a
turn that ends when the pins are full keeps at most its shared prefix (below; the rest of its context stays an
ordinary cache entry). Except a pin that is overdue: the gaps between a session's turn and its next one are
observed (how long tools take here), and a pin older than ``OVERDUE_FACTOR`` times the longest recent gap most
likely belongs to an agent that finished (its last turn's pin would otherwise hold its share for the whole
TTL): overdue pins give way before all others, the most overdue first.

A pin that gives way first falls back to the part of its context other contexts share (the system prompt and
tool schemas every agent sends: the deepest node above it where the tree branched when its turn ended), and
lets go of that only when every full pin has given way. Under pressure the shared prefix is what every turn
of every agent reads: when the last pin over it let go, least-recently-used eviction took it with the rest
(the agents' later turns, arriving after a burst of others' tokens, recomputed the system prompt).

A session names a pin only: sessions of different callers never see each other's data (the prefix cache is
shared by content anyway); a name reused by two conversations keeps the later one warm.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

from parallm_engine.kv.page_pool import PAGE

#: Seconds a finished turn's context stays pinned (``Engine(session_ttl=)``, the default): a tool call's
#: time. 0 turns sessions off.
DEFAULT_TTL_S = 30.0
#: The share of the KV budget sessions may pin (the running rows keep the rest: preemption and admission
#: count pinned bytes as taken). Half: under memory pressure the rows keep room for a few turns at once (on
#: a CPU a decode step of one row costs nearly what one of several does).
DEFAULT_SHARE = 0.5
#: A pin not followed by its session's next turn within this many times the longest gap between turns seen
#: recently is overdue (its agent most likely finished): it gives way first. Needs ``MIN_GAPS`` gaps seen.
OVERDUE_FACTOR = 1.5
MIN_GAPS = 3


@dataclass
class _Pin:
    node: object  # the radix node at the end of the context (pinned with its path)
    expires: float
    shared_only: bool = False  # it gave way once: it pins only the prefix other contexts share
    shared: object = None  # that prefix's node (where the tree branched when the turn ended), or None
    kept_at: float = 0.0  # when its turn ended
    returned: bool = False  # its session's next turn has arrived (the gap is measured)


def _shared_ancestor(node):
    """The deepest node above ``node`` where the tree branches (a prefix other contexts continue too), or None."""
    up = node.parent
    while up is not None and up.parent is not None:
        if len(up.children) > 1:
            return up
        up = up.parent
    return None


def _depth(node) -> int:
    """Tokens from the root to the end of ``node``."""
    n = 0
    while node is not None and node.parent is not None:
        n += len(node.tokens)
        node = node.parent
    return n


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
        self.gaps: deque[float] = deque(maxlen=64)  # seconds from a turn's end to its session's next turn
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
        now = time.monotonic()
        expires = now + self.ttl_s
        if match.length:
            # The shared prefix is found now, while the other agents' contexts branch off it (later they may
            # have been evicted, leaving this one a single path).
            shared = _shared_ancestor(match.node)
            if shared is None and old is not None and old.shared is not None and _is_ancestor(old.shared, match.node):
                shared = old.shared
            self.radix.pin(match.node)
            self.pins[session] = _Pin(match.node, expires, shared=shared, kept_at=now)
            self.kept += 1
        if old is not None:
            self.radix.unpin(old.node)
        # No room for all of it: the pin kept last (this one) keeps what fits (at least the context it had, if
        # that fitted: its next turn recomputes only the rest), rather than letting go of all of it.
        self.bound()

    def bound(self) -> None:
        """Within ``max_bytes``: the pins kept last give up the end of their context first (see the module
        docstring)."""
        while self.nbytes > self.max_bytes and self.pins:
            self._shrink(self._order()[0], -(-(self.nbytes - self.max_bytes) // max(1, self.bytes_per_token)))
            self.displaced += 1

    def give_way(self, keep: str | None = None, nbytes: int = 0) -> bool:
        """Memory is short by ``nbytes`` (rows to run, a request to admit; 0: unknown): the pin kept last, other
        than ``keep``'s, whose giving way frees memory now gives up the end of its context, about ``nbytes``
        of it (a page more: pages are whole), or all but the prefix it shares with other contexts, or (it had
        only that) all of it (:meth:`_shrink`); fallen-back pins go after every full one. A pin over pages
        running rows hold frees nothing: it stays (dropping it would only expose the prefix to eviction once
        the rows leave). False when no pin frees anything."""
        before = self.radix.pinned_bytes()
        tokens = -(-nbytes // max(1, self.bytes_per_token)) + PAGE if nbytes > 0 else None
        for session in self._order(keep):
            undo = self._shrink(session, tokens)
            if self.radix.pinned_bytes() < before:
                self.displaced += 1
                return True
            undo()
        return False

    def holds_own(self, session: str | None) -> bool:
        """``session``'s pin holds its own context (not only the prefix it shares with others)."""
        pin = self.pins.get(session) if session is not None else None
        return pin is not None and not pin.shared_only

    def overdue_after(self) -> float | None:
        """Seconds after which a pin whose session has not come back is overdue (None: too few gaps seen)."""
        return OVERDUE_FACTOR * max(self.gaps) if len(self.gaps) >= MIN_GAPS else None

    def _order(self, keep: str | None = None, now: float | None = None) -> list[str]:
        """Who gives way first: overdue pins (the most overdue first), then full pins before fallen-back ones,
        the one kept last first."""
        now = time.monotonic() if now is None else now
        after = self.overdue_after()

        def overdue(p: _Pin) -> float:
            age = now - p.kept_at
            return age if after is not None and not p.returned and age > after else 0.0

        ranked = sorted(((overdue(p), not p.shared_only, p.expires, s) for s, p in self.pins.items() if s != keep),
                        reverse=True)
        return [r[-1] for r in ranked]

    def _shrink(self, session: str, tokens: int | None):
        """``session``'s pin lets go of its last ``tokens`` (None: all) down to the prefix its context shares
        with others; one pinning only that lets go entirely (with every other fallen-back pin over the same
        prefix: one alone frees nothing). Returns the undo."""
        pin = self.pins[session]
        if pin.shared_only:
            group = {s: p for s, p in self.pins.items() if s == session or (p.shared_only and p.node is pin.node)}
            for s in group:
                self._drop(s)

            def undo_drop():
                for s, p in group.items():
                    self.radix.pin(p.node)
                    self.pins[s] = p
            return undo_drop
        end = _depth(pin.node)
        floor = _depth(pin.shared) if pin.shared is not None and pin.shared is not pin.node else 0
        if tokens is None or end - tokens <= floor:
            if floor:  # down to the shared prefix
                to = replace(pin, node=pin.shared, shared_only=True)
            else:  # nothing shared: all of it
                self._drop(session)
                return lambda: (self.radix.pin(pin.node), self.pins.__setitem__(session, pin))
        else:  # the end of its context: the next turn recomputes only that
            ns, nodes = self.radix.path(pin.node)
            ids = [t for nd in nodes for t in nd.tokens]
            node = self.radix.match(ids[: end - tokens], record=False, ns=ns).node
            to = replace(pin, node=node)
        self.radix.pin(to.node)
        self.radix.unpin(pin.node)
        self.pins[session] = to

        def undo():
            self.radix.pin(pin.node)
            self.radix.unpin(to.node)
            self.pins[session] = pin
        return undo

    def let_go_all(self):
        """Every pin lets go (nothing counted); returns the undo (the scheduler asks what that would free)."""
        pins, self.pins = self.pins, {}
        for pin in pins.values():
            self.radix.unpin(pin.node)

        def undo():
            for pin in pins.values():
                self.radix.pin(pin.node)
            self.pins = pins
        return undo

    def expire(self, now: float | None = None, waiting=()) -> int:
        """Let go of the pins whose time is up, but not those of the sessions in ``waiting`` (their next turn
        is queued: on a busy engine it may wait longer than the TTL, and it is the turn the pin is for);
        returns how many."""
        now = time.monotonic() if now is None else now
        for s in waiting:  # a session's next turn arrived: how long its tool took (and the turn's delivery)
            pin = self.pins.get(s)
            if pin is not None and not pin.returned:
                pin.returned = True
                self.gaps.append(max(0.0, now - pin.kept_at))
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
                "sessions_released": self.released, "sessions_displaced": self.displaced,
                "sessions_overdue_after_s": round(self.overdue_after() or 0.0, 3)}
