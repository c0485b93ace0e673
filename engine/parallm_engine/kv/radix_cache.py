"""SGLang-style radix tree over token ids whose nodes hold KV segments.

Each edge is labelled with a run of tokens (compressed); the node at its end holds that run's keys and
values for every layer, either by reference as slots of a decode lane's page pool
(``kv_pages.PagedSegment``: the pages the rows wrote; rows borrow them back, so a prefix is held once
however many rows and nodes use it, and a split copies nothing) or as its own (1, H, n, D) arrays (a
prefix the decode batch reads once for all its rows, ``kv_cache.SharedPrefix``; the engine's tests).
Sequences pin the deepest node they matched; pins count up the parent chain, so splitting a node keeps
every pin valid. Unpinned leaves are evicted least-recently-used when the tree exceeds its byte budget.
Each namespace (``ns``: a LoRA adapter's key, ``lora_adapters.LoRAAdapter.key``; None: the base model) has
its own root: KV computed under one adapter is never matched by another's tokens (adapters change every
layer's keys and values), while rows of one adapter share prefixes as the base's rows do.
The tree's bytes are its arrays plus the pages only it holds (pages a row also holds are the row's):
``page_nbytes``, ``cached_pages`` and ``pinned_cached_pages`` are set by the owner of the pools (the KV cache
manager, ``kv/kv_cache_manager.py``). A pinned node's paged segment is pinned in its pool
(``PagedSegment.pin``), which keeps the count of pinned pages no row holds as pages change hands.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from parallm_engine.kv import kv_quant as kvq
from parallm_engine.kv.kv_pages import PagedSegment

# One KV segment: per layer (keys, values), each (1, H, n, D) (``kv_quant.QuantizedKV`` when quantized).
Segment = list[tuple[mx.array, mx.array]]


def _segment_nbytes(seg) -> int:
    """Bytes of a segment's own arrays (a paged segment's pages are counted by the pool)."""
    if seg is None or isinstance(seg, PagedSegment):
        return 0
    return sum(k.nbytes + v.nbytes for k, v in seg)


def _segment_arrays(seg) -> list[mx.array]:
    if isinstance(seg, PagedSegment):
        return []
    return [a for k, v in seg for x in (k, v) for a in kvq.arrays(x)]


def segment_layers(seg) -> Segment:
    """A node's KV per layer (keys, values), (1, H, n, D): its own arrays, or lazy gathers from its pages."""
    return seg.layers() if isinstance(seg, PagedSegment) else seg


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
        self.roots: dict = {None: self.root}  # one root per namespace (see the module docstring)
        self.array_bytes = 0  # the nodes' own arrays
        self._pinned_bytes = 0  # of those, pinned nodes' (kept by pin / unpin / split: asked every step)
        # Paged segments: bytes of one page, how many pages only the tree holds, and how many of those
        # pinned nodes hold (every lane's pool; running counts kept by the pools, PagePool.pinned_cached).
        self.page_nbytes = 0
        self.cached_pages: Callable[[], int] = lambda: 0
        self.pinned_cached_pages: Callable[[], int] = lambda: 0
        self._reads: dict[tuple, tuple] = {}  # this prefill phase's gathered prefixes (gather)
        self._nodes = 0  # kept as nodes come and go, so stats() is O(1) (published every step)
        self._tokens = 0
        self.evictions = 0
        self.evicted_tokens = 0
        self.lookups = 0
        self.lookup_tokens = 0
        self.hit_tokens = 0
        # Called with (namespace, path from the root's child to the leaf) before a leaf is evicted for room
        # (the disk tier keeps what it completes); not for clear() or dropped pools.
        self.on_evict: Callable[[object, list[RadixNode]], None] | None = None
        # Block events for routers outside the engine (kv/kv_events.KVEventLog), or None.
        self.events = None

    @property
    def total_bytes(self) -> int:
        """What the tree alone keeps alive: its arrays and the pages no row holds."""
        return self.array_bytes + self.cached_pages() * self.page_nbytes

    # -- lookup ---------------------------------------------------------------------------------
    def _root(self, ns) -> RadixNode:
        root = self.roots.get(ns)
        if root is None:
            root = self.roots[ns] = RadixNode((), None, None)
            root.ref = 1
        return root

    def match(self, tokens: Sequence[int], record: bool = True, ns=None) -> PrefixMatch:
        """Longest stored prefix of ``tokens`` in namespace ``ns``. Splits an edge matched part-way, so
        the match always ends on a node boundary."""
        node, i, n = self._root(ns), 0, len(tokens)
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

    def pinned_prefix(self, tokens: Sequence[int], ns=None) -> int:
        """Leading tokens of ``tokens`` stored in pinned nodes (pins cover a node's whole path, so these are a
        prefix of the match). Looks only: no split, no recency, no counters."""
        node, i, n = self.roots.get(ns), 0, len(tokens)
        while node is not None and i < n:
            child = node.children.get(tokens[i])
            if child is None or not child.ref:
                break
            edge = child.tokens
            part = tuple(tokens[i : i + len(edge)])
            if part != edge:
                return i + common_prefix_len(edge, part)
            node, i = child, i + len(edge)
        return i

    def gather(self, match: PrefixMatch) -> Segment | None:
        """The matched prefix's KV, concatenated per layer: (1, H, length, D) arrays. A node's own arrays
        are handed out as they are; a prefix read from pages or from several nodes is built once per
        prefill phase (until :meth:`end_reads`) however many sequences match it, so a prefill group whose
        rows continue it reads one copy, not one per row (a hit held in another pool, a shared prefix
        of several nodes)."""
        nodes = match.nodes()
        if not nodes:
            return None
        if len(nodes) == 1 and not isinstance(nodes[0].kv, PagedSegment):
            return list(nodes[0].kv)
        key = tuple((id(nd.kv), len(nd.tokens)) for nd in nodes)
        if key not in self._reads:
            segs = [segment_layers(nd.kv) for nd in nodes]
            kv = list(segs[0]) if len(segs) == 1 else [
                (
                    kvq.concatenate([seg[l][0] for seg in segs], axis=2),
                    kvq.concatenate([seg[l][1] for seg in segs], axis=2),
                )
                for l in range(len(segs[0]))
            ]
            # the segments are kept with it, so their ids (the key) are not reused while it is cached
            self._reads[key] = ([nd.kv for nd in nodes], kv)
        return self._reads[key][1]

    @staticmethod
    def lendable_slots(match: PrefixMatch | None, lane, start: int) -> np.ndarray:
        """Slots of ``lane``'s pool (a ``kv_pages.PagedLaneKV``) holding the matched tokens [start, b),
        for the largest b whose nodes hold them there as pages (empty: none). A sequence that read its
        prefix from the tree (its pinned match) gets the same numbers reading them from these pages."""
        parts, pos = [], 0
        for node in match.nodes() if match is not None else []:
            end = pos + len(node.tokens)
            if end > start:
                seg = node.kv
                if not isinstance(seg, PagedSegment) or seg.lane is not lane:
                    break
                parts.append(seg.slots[max(0, start - pos):])
            pos = end
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def end_reads(self) -> None:
        """The prefill phase is over: forget the prefixes :meth:`gather` built (the sequences that read
        them keep what they use)."""
        self._reads.clear()

    def own_arrays(self, node: RadixNode) -> Segment:
        """``node``'s KV as its own arrays (a paged node copies its slots out and gives its pages back):
        what a decode batch reads as one shared prefix."""
        if isinstance(node.kv, PagedSegment):
            seg = node.kv
            kv = [(kvq.contiguous(k), kvq.contiguous(v)) for k, v in seg.layers()]
            mx.eval(_segment_arrays(kv))
            seg.lane.meter.moved += _segment_nbytes(kv)  # out of the pages (given back) into arrays
            seg.release()
            self._set_kv(node, kv)
        return node.kv

    def _set_kv(self, node: RadixNode, kv) -> None:
        """Replace a node's segment, keeping the byte and pin counters."""
        nbytes = _segment_nbytes(kv)
        self.array_bytes += nbytes - node.nbytes
        if node.ref:
            self._pinned_bytes += nbytes - node.nbytes
            if isinstance(node.kv, PagedSegment):
                node.kv.unpin()
            if isinstance(kv, PagedSegment):
                kv.pin()
        node.kv, node.nbytes = kv, nbytes

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Split ``node``'s edge after k tokens; returns the new upper node (holding tokens[:k])."""
        parent = node.parent
        if isinstance(node.kv, PagedSegment):
            upper_kv, lower_kv = node.kv.split(k)  # no copy: the slots are cut
        else:
            upper_kv, lower_kv = _slice_segment(node.kv, 0, k), _slice_segment(node.kv, k, None)
        upper = RadixNode(node.tokens[:k], None, parent)
        upper.ref = node.ref  # everyone pinning node pinned its whole path, which now includes upper
        self._nodes += 1
        upper.last_used = node.last_used
        self._set_kv(upper, upper_kv)
        self._set_kv(node, lower_kv)
        node.tokens = node.tokens[k:]
        node.parent = upper
        upper.children[node.tokens[0]] = node
        parent.children[upper.tokens[0]] = upper
        if self.events is not None:
            self.events.split(node, upper, k)
        return upper

    # -- insert ---------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], kv_for: Callable[[int, int], Segment], ns=None) -> PrefixMatch:
        """Store ``tokens``. ``kv_for(start, end)`` returns KV for tokens[start:end] (private copies, or a
        ``PagedSegment`` holding the pages they are in) and is called only for the part not already in
        the tree. Returns the match of the full run, with ``held``: how many tokens the tree already had."""
        m = self.match(tokens, record=False, ns=ns)
        m.held = m.length
        if m.length < len(tokens):
            seg = kv_for(m.length, len(tokens))
            mx.eval(_segment_arrays(seg))
            leaf = RadixNode(tuple(tokens[m.length :]), seg, m.node)
            m.node.children[leaf.tokens[0]] = leaf
            self.array_bytes += leaf.nbytes
            self._nodes += 1
            self._tokens += len(leaf.tokens)
            if self.events is not None:
                self.events.stored(ns, tokens, m.length, leaf)
            m = PrefixMatch(leaf, len(tokens), held=m.length)
        self.evict_to_budget()
        return m

    # -- pins -----------------------------------------------------------------------------------
    def pin(self, node: RadixNode) -> None:
        while node is not None:
            node.ref += 1
            if node.ref == 1:
                self._pinned_bytes += node.nbytes
                if isinstance(node.kv, PagedSegment):
                    node.kv.pin()
            node = node.parent

    def unpin(self, node: RadixNode) -> None:
        while node is not None:
            node.ref -= 1
            assert node.ref >= 0, "radix node unpinned more often than pinned"
            if node.ref == 0:
                self._pinned_bytes -= node.nbytes
                if isinstance(node.kv, PagedSegment):
                    node.kv.unpin()
            node = node.parent

    # -- eviction -------------------------------------------------------------------------------
    def evict_to_budget(self) -> int:
        return self.evict(max(0, self.total_bytes - self.max_bytes))

    def evict(self, nbytes: int) -> int:
        """Free at least ``nbytes`` (if unpinned leaves allow), least recently used first. A paged leaf
        all of whose pages running rows also hold frees nothing: it goes only when an unpinned ancestor
        holds pages no row does (a prefix the rows read from the batch's shared copy), to reach them."""
        freed = 0
        while freed < nbytes:
            leaves = [n for n in self._iter_nodes() if not n.children and n.ref == 0]
            leaves = [(not self._frees(n), n.last_used, n) for n in leaves]
            leaves = [x for x in leaves if not x[0] or self._unlocks(x[2])]
            if not leaves:
                break
            leaves.sort(key=lambda x: x[:2])
            for _, _, leaf in leaves:
                before = self.total_bytes
                if self.on_evict is not None:
                    self.on_evict(*self.path(leaf))
                self._remove_leaf(leaf)
                freed += before - self.total_bytes
                if freed >= nbytes:
                    break
        return freed

    @staticmethod
    def _frees(node: RadixNode) -> bool:
        """Evicting it frees something, now or once its parent goes too (a page it shares with it)."""
        if isinstance(node.kv, PagedSegment):
            return node.kv.cached_pages() > 0
        return True

    def _unlocks(self, leaf: RadixNode) -> bool:
        """An unpinned ancestor frees something (nothing below an unpinned node is pinned: evicting
        leaves reaches it)."""
        node = leaf.parent
        while node is not None and node.parent is not None and node.ref == 0:
            if self._frees(node):
                return True
            node = node.parent
        return False

    def _remove_leaf(self, leaf: RadixNode) -> None:
        if self.events is not None:
            self.events.removed(leaf)
        del leaf.parent.children[leaf.tokens[0]]
        self.array_bytes -= leaf.nbytes
        self._nodes -= 1
        self._tokens -= len(leaf.tokens)
        self.evictions += 1
        self.evicted_tokens += len(leaf.tokens)
        if isinstance(leaf.kv, PagedSegment):
            leaf.kv.release()
        leaf.kv = None
        leaf.parent = None

    def clear(self) -> None:
        """Drop every unpinned node."""
        while True:
            leaves = [n for n in self._iter_nodes() if not n.children and n.ref == 0]
            if not leaves:
                break
            for leaf in leaves:
                self._remove_leaf(leaf)

    def drop_lanes(self, lanes: list) -> None:
        """The decode lanes' pools are gone (the batch was cleared after a failure): nodes holding their
        pages leave the tree with everything below them; a pinned one keeps a copy of its KV instead."""
        doomed = [n for n in self._iter_nodes() if isinstance(n.kv, PagedSegment) and n.kv.lane in lanes]
        for node in doomed:
            if node.parent is None:
                continue  # already gone with an ancestor
            if node.ref:
                self.own_arrays(node)
                continue
            stack = [node]
            order = []
            while stack:
                n = stack.pop()
                order.append(n)
                stack.extend(n.children.values())
            for n in reversed(order):  # leaves first
                self._remove_leaf(n)

    def clear_unpinned(self) -> int:
        """:meth:`clear`, returning the bytes freed."""
        before = self.total_bytes
        self.clear()
        return before - self.total_bytes

    # -- introspection --------------------------------------------------------------------------
    def path(self, node: RadixNode) -> tuple:
        """``node``'s namespace and the nodes from its root's child down to it."""
        nodes = []
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        ns = next(k for k, root in self.roots.items() if root is node)
        return ns, nodes[::-1]

    def leaves(self) -> list[RadixNode]:
        return [n for n in self._iter_nodes() if not n.children]

    def _iter_nodes(self):
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def num_nodes(self) -> int:
        return sum(1 for _ in self._iter_nodes())

    def num_tokens(self) -> int:
        return sum(len(n.tokens) for n in self._iter_nodes())

    def pinned_bytes(self) -> int:
        """Bytes of pinned nodes (on the path of a pinned node) that only the tree holds: not evictable now."""
        return self._pinned_bytes + self.pinned_cached_pages() * self.page_nbytes

    def computed_pinned_bytes(self) -> int:
        """Recount of :meth:`pinned_bytes` from the nodes (tests compare the two)."""
        pinned = [n for n in self._iter_nodes() if n.ref]
        return sum(_segment_nbytes(n.kv) for n in pinned) + self._cached_pages_of(pinned) * self.page_nbytes

    def computed_bytes(self) -> int:
        """Recount from the segments themselves and the pools' holders (tests compare it with
        ``total_bytes``)."""
        nodes = list(self._iter_nodes())
        return sum(_segment_nbytes(n.kv) for n in nodes) + self._cached_pages_of(nodes) * self.page_nbytes

    @staticmethod
    def _cached_pages_of(nodes) -> int:
        """Distinct pages of these nodes' paged segments that no row holds."""
        pages = set()
        for n in nodes:
            seg = n.kv
            if isinstance(seg, PagedSegment):
                refs = seg.lane.pool.refs
                pages.update((id(seg.lane), p) for p in seg.pages if not refs[p])
        return len(pages)

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


def common_prefix_len(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Leading elements ``a`` and ``b`` share (at most ``limit``). Halved by slice compares, which run in C:
    the planner asks this for prompts sharing thousands of tokens (an agents' system prompt) every step."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    lo, hi = 0, n  # a[:lo] == b[:lo]; the first difference (or n) is in [lo, hi]
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


def shared_context_len(a, b) -> int:
    """Leading context tokens whose KV sequences ``a`` and ``b`` compute alike: their common prefix under one
    adapter."""
    return common_prefix_len(a.prefill_ids, b.prefill_ids) if a.adapter_key == b.adapter_key else 0
