"""Prefix reuse for models whose caches cannot be cut at any token: whole-state snapshots.

A recurrent / SSM state after N tokens summarises all N tokens, and a sliding-window cache after N
tokens holds only the last ``window`` of them: neither can be sliced to give the state after M < N
tokens. So, as SGLang's Mamba radix cache and vLLM's hybrid allocator do, the engine stores the
complete per-layer caches at chosen token boundaries (a prompt's end, a turn's end, the end of a
prefix that several waiting prompts share) and reuses a snapshot only for a prompt that continues
exactly those tokens. A hit restores copies of the caches (``model_caches.copy_caches``) and
prefills the rest: the same state a cold run reaches.

Entries are keyed by their token tuple and grouped by length, so the longest stored prefix of a
prompt is found with one hash lookup per distinct stored length. Unpinned entries are evicted least
recently used under a byte budget; byte accounting is the sum of the snapshots' arrays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from parallm_engine.kv.model_caches import caches_nbytes, copy_caches


@dataclass
class Snapshot:
    tokens: tuple[int, ...]
    caches: list
    nbytes: int
    last_used: float = field(default_factory=time.monotonic)
    ref: int = 0
    ns: object = None  # namespace: a LoRA adapter's key (None: the base model); never matched across


class SnapshotCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._by_len: dict[int, dict[tuple, Snapshot]] = {}  # by length: (namespace, tokens) -> snapshot
        self.total_bytes = 0
        self.evictions = 0
        self.evicted_tokens = 0
        self.lookups = 0
        self.lookup_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return sum(len(d) for d in self._by_len.values())

    def match(self, tokens, record: bool = True, ns=None) -> Snapshot | None:
        """The longest stored snapshot in namespace ``ns`` whose tokens are a prefix of ``tokens`` (None: no hit)."""
        hit = None
        for n in sorted(self._by_len, reverse=True):
            if n > len(tokens):
                continue
            snap = self._by_len[n].get((ns, tuple(tokens[:n])))
            if snap is not None:
                hit = snap
                break
        if record:
            self.lookups += 1
            self.lookup_tokens += len(tokens)
            self.hit_tokens += len(hit.tokens) if hit else 0
        if hit is not None:
            hit.last_used = time.monotonic()
        return hit

    def restore(self, snap: Snapshot) -> list:
        """Fresh caches holding the snapshot's state (the snapshot itself is never written)."""
        snap.last_used = time.monotonic()
        return copy_caches(snap.caches)

    def insert(self, tokens, caches: list, ns=None) -> bool:
        """Store a copy of ``caches`` as the state after ``tokens`` (a no-op when already stored or
        when one snapshot alone exceeds the budget). Returns whether it is stored now."""
        toks = tuple(tokens)
        if not toks:
            return False
        key = (ns, toks)
        bucket = self._by_len.setdefault(len(toks), {})
        if key in bucket:
            bucket[key].last_used = time.monotonic()
            return True
        copy = copy_caches(caches)
        nbytes = caches_nbytes(copy)
        if nbytes > self.max_bytes:
            if not bucket:
                del self._by_len[len(toks)]
            return False
        bucket[key] = Snapshot(toks, copy, nbytes, ns=ns)
        self.total_bytes += nbytes
        self.evict(max(0, self.total_bytes - self.max_bytes))
        return key in bucket

    def pin(self, snap: Snapshot) -> None:
        snap.ref += 1

    def unpin(self, snap: Snapshot) -> None:
        snap.ref -= 1
        assert snap.ref >= 0, "snapshot unpinned more often than pinned"

    def evict(self, nbytes: int) -> int:
        """Free at least ``nbytes`` (if unpinned entries allow), least recently used first."""
        freed = 0
        if nbytes <= 0:
            return 0
        entries = sorted((s for d in self._by_len.values() for s in d.values() if s.ref == 0),
                         key=lambda s: s.last_used)
        for snap in entries:
            if freed >= nbytes:
                break
            bucket = self._by_len[len(snap.tokens)]
            del bucket[(snap.ns, snap.tokens)]
            if not bucket:
                del self._by_len[len(snap.tokens)]
            self.total_bytes -= snap.nbytes
            self.evictions += 1
            self.evicted_tokens += len(snap.tokens)
            freed += snap.nbytes
        return freed

    def evict_to_budget(self) -> int:
        return self.evict(max(0, self.total_bytes - self.max_bytes))

    def clear_unpinned(self) -> int:
        return self.evict(self.total_bytes + 1)

    def pinned_bytes(self) -> int:
        """Bytes of snapshots a prefilling sequence holds (not evictable now)."""
        return sum(s.nbytes for d in self._by_len.values() for s in d.values() if s.ref)

    def computed_bytes(self) -> int:
        return sum(caches_nbytes(s.caches) for d in self._by_len.values() for s in d.values())

    def stats(self) -> dict:
        return {
            "kind": "snapshots",
            "bytes": self.total_bytes,
            "max_bytes": self.max_bytes,
            "nodes": len(self),
            "tokens": sum(len(s.tokens) for d in self._by_len.values() for s in d.values()),
            "evictions": self.evictions,
            "evicted_tokens": self.evicted_tokens,
            "lookups": self.lookups,
            "lookup_tokens": self.lookup_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": (self.hit_tokens / self.lookup_tokens) if self.lookup_tokens else 0.0,
        }
