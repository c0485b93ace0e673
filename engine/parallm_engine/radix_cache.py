"""SGLang-style radix tree over token ids whose nodes own KV segments.

Each edge is labelled with a run of tokens (compressed); the node at its end owns that run's keys and
values for every layer, as (1, H, n, D) arrays. A prefix is stored once however many sequences use
it. Sequences pin the deepest node they matched; pins count up the parent chain, so splitting a node
keeps every pin valid. Unpinned leaves are evicted least-recently-used when the tree exceeds its byte
budget, and byte accounting is exact (the sum of the segments' ``nbytes``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

from . import kv_quant as kvq

# One KV segment: per layer (keys, values), each (1, H, n, D) (``kv_quant.QuantizedKV`` when quantized).
Segment = list[tuple[mx.array, mx.array]]


def _segment_nbytes(seg: Segment) -> int:
    return sum(k.nbytes + v.nbytes for k, v in seg)


def _segment_arrays(seg: Segment) -> list[mx.array]:
    return [a for k, v in seg for x in (k, v) for a in kvq.arrays(x)]


def _slice_segment(seg: Segment, start: int, end: int | None) -> Segment:
    out = [(kvq.contiguous(k[..., start:end, :]), kvq.contiguous(v[..., start:end, :])) for k, v in seg]
    mx.eval(_segment_arrays(out))
    return out


_ids = itertools.count()


class RadixNode:
    __slots__ = ("id", "tokens", "kv", "children", "parent", "ref", "last_used", "nbytes")

    def __init__(self, tokens: tuple[int, ...], kv: Segment | None, parent: "RadixNode | None"):
        self.id = next(_ids)
        self.tokens = tokens
        self.kv = kv
        self.children: dict[int, RadixNode] = {}
        self.parent = parent
        self.ref = 0
        self.last_used = time.monotonic()
        self.nbytes = _segment_nbytes(kv) if kv else 0

    def __repr__(self) -> str:
        return f"RadixNode(id={self.id}, n={len(self.tokens)}, ref={self.ref}, children={len(self.children)})"


@dataclass
class PrefixMatch:
    node: RadixNode  # deepest matched node (the root when nothing matched)
    length: int  # tokens matched
    held: int = 0  # after an insert: tokens the tree already held before it

    def nodes(self) -> list[RadixNode]:
        """Matched nodes from the root down (the root excluded)."""
        out = []
        n = self.node
        while n.parent is not None:
            out.append(n)
            n = n.parent
        return out[::-1]


class RadixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.root = RadixNode((), None, None)
        self.root.ref = 1  # never evicted
        self.total_bytes = 0
        self._pinned_bytes = 0  # kept by pin / unpin / split, so the scheduler can ask every step
        self._nodes = 0  # kept as nodes come and go, so stats() is O(1) (published every step)
        self._tokens = 0
        self.evictions = 0
        self.evicted_tokens = 0
        self.lookups = 0
        self.lookup_tokens = 0
        self.hit_tokens = 0

    # -- lookup ---------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], record: bool = True) -> PrefixMatch:
        """Longest stored prefix of ``tokens``. Splits an edge matched part-way, so the match always
        ends on a node boundary."""
        node, i, n = self.root, 0, len(tokens)
        now = time.monotonic()
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            edge = child.tokens
            k = 0
            limit = min(len(edge), n - i)
            while k < limit and edge[k] == tokens[i + k]:
                k += 1
            if k < len(edge):
                child = self._split(child, k)
            child.last_used = now
            node, i = child, i + k
            if k < len(edge):
                break
        if record:
            self.lookups += 1
            self.lookup_tokens += n
            self.hit_tokens += i
        return PrefixMatch(node, i)

    def gather(self, match: PrefixMatch) -> Segment | None:
        """The matched prefix's KV, concatenated per layer: (1, H, length, D) arrays."""
        nodes = match.nodes()
        if not nodes:
            return None
        if len(nodes) == 1:
            return list(nodes[0].kv)
        layers = len(nodes[0].kv)
        return [
            (
                kvq.concatenate([nd.kv[l][0] for nd in nodes], axis=2),
                kvq.concatenate([nd.kv[l][1] for nd in nodes], axis=2),
            )
            for l in range(layers)
        ]

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Split ``node``'s edge after k tokens; returns the new upper node (holding tokens[:k])."""
        parent = node.parent
        upper = RadixNode(node.tokens[:k], _slice_segment(node.kv, 0, k), parent)
        upper.ref = node.ref  # everyone pinning node pinned its whole path, which now includes upper
        self._nodes += 1
        upper.last_used = node.last_used
        lower_kv = _slice_segment(node.kv, k, None)
        grown = upper.nbytes + _segment_nbytes(lower_kv) - node.nbytes
        self.total_bytes += grown
        if node.ref:
            self._pinned_bytes += grown
        node.kv = lower_kv
        node.nbytes = _segment_nbytes(lower_kv)
        node.tokens = node.tokens[k:]
        node.parent = upper
        upper.children[node.tokens[0]] = node
        parent.children[upper.tokens[0]] = upper
        return upper

    # -- insert ---------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], kv_for: Callable[[int, int], Segment]) -> PrefixMatch:
        """Store ``tokens``. ``kv_for(start, end)`` returns private KV copies for tokens[start:end]
        and is called only for the part not already in the tree. Returns the match of the full run, with
        ``held``: how many tokens the tree already had."""
        m = self.match(tokens, record=False)
        m.held = m.length
        if m.length < len(tokens):
            seg = kv_for(m.length, len(tokens))
            mx.eval(_segment_arrays(seg))
            leaf = RadixNode(tuple(tokens[m.length :]), seg, m.node)
            m.node.children[leaf.tokens[0]] = leaf
            self.total_bytes += leaf.nbytes
            self._nodes += 1
            self._tokens += len(leaf.tokens)
            m = PrefixMatch(leaf, len(tokens), held=m.length)
        self.evict_to_budget()
        return m

    # -- pins -----------------------------------------------------------------------------------
    def pin(self, node: RadixNode) -> None:
        while node is not None:
            node.ref += 1
            if node.ref == 1:
                self._pinned_bytes += node.nbytes
            node = node.parent

    def unpin(self, node: RadixNode) -> None:
        while node is not None:
            node.ref -= 1
            assert node.ref >= 0, "radix node unpinned more often than pinned"
            if node.ref == 0:
                self._pinned_bytes -= node.nbytes
            node = node.parent

    # -- eviction -------------------------------------------------------------------------------
    def evict_to_budget(self) -> int:
        return self.evict(max(0, self.total_bytes - self.max_bytes))

    def evict(self, nbytes: int) -> int:
        """Free at least ``nbytes`` (if unpinned leaves allow), least recently used first."""
        freed = 0
        while freed < nbytes:
            leaves = [n for n in self._iter_nodes() if not n.children and n.ref == 0]
            if not leaves:
                break
            leaves.sort(key=lambda n: n.last_used)
            for leaf in leaves:
                freed += self._remove_leaf(leaf)
                if freed >= nbytes:
                    break
        return freed

    def _remove_leaf(self, leaf: RadixNode) -> int:
        del leaf.parent.children[leaf.tokens[0]]
        self.total_bytes -= leaf.nbytes
        self._nodes -= 1
        self._tokens -= len(leaf.tokens)
        self.evictions += 1
        self.evicted_tokens += len(leaf.tokens)
        freed = leaf.nbytes
        leaf.kv = None
        leaf.parent = None
        return freed

    def clear(self) -> None:
        """Drop every unpinned node."""
        self.evict(self.total_bytes + 1)

    def clear_unpinned(self) -> int:
        """:meth:`clear`, returning the bytes freed."""
        before = self.total_bytes
        self.clear()
        return before - self.total_bytes

    # -- introspection --------------------------------------------------------------------------
    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def num_nodes(self) -> int:
        return sum(1 for _ in self._iter_nodes())

    def num_tokens(self) -> int:
        return sum(len(n.tokens) for n in self._iter_nodes())

    def pinned_bytes(self) -> int:
        """Bytes of pinned nodes (on the path of a pinned node): not evictable now."""
        return self._pinned_bytes

    def computed_pinned_bytes(self) -> int:
        """Recount of :meth:`pinned_bytes` from the nodes (tests compare the two)."""
        return sum(n.nbytes for n in self._iter_nodes() if n.ref)

    def computed_bytes(self) -> int:
        """Recount from the segments themselves (tests compare it with ``total_bytes``)."""
        return sum(_segment_nbytes(n.kv) for n in self._iter_nodes())

    def stats(self) -> dict:
        return {
            "bytes": self.total_bytes,
            "max_bytes": self.max_bytes,
            "nodes": self._nodes,
            "tokens": self._tokens,
            "evictions": self.evictions,
            "evicted_tokens": self.evicted_tokens,
            "lookups": self.lookups,
            "lookup_tokens": self.lookup_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": (self.hit_tokens / self.lookup_tokens) if self.lookup_tokens else 0.0,
        }
