"""Page accounting for the paged KV (``kv_pages``): which pages of a lane's pool are free, who holds
each used page, and where a row's or a prefix-cache entry's tokens sit.

A page holds ``PAGE`` consecutive token slots. Rows hold pages (their own, which only they write, and
pages of a prefix they borrow from the prefix cache, read-only); the radix tree's entries hold pages by
reference (:class:`PagedSegment`). :class:`PagePool` counts both kinds of holder per page; a page with
neither is free. Pure bookkeeping on the host: the arrays live in ``kv_pages.PagedLayerKV``.
"""

from __future__ import annotations

import numpy as np

PAGE = 8  # tokens per page (allocation granularity; attention reads the table token by token)
_GROW = 1.25  # pool arrays grow geometrically (each growth is one copy of the pool) ...
SHRINK_SLACK = 2  # ... and shrink (one gather) to _GROW x the pages in use when they hold more than twice that
MIN_PAGES = 32


class PagePool:
    """Which pages of a lane are free and who holds each used page: ``refs`` counts the rows holding it
    (their own pages, or a prefix they borrow from the prefix cache), ``tree`` the prefix cache's
    entries holding it (:class:`PagedSegment`). A page is free when neither holds it; ``cached`` pages
    are held by the prefix cache alone. ``pinned`` counts the pinned entries holding a page (a prompt's
    matched prefix, a session's context: ``radix_cache``), and ``pinned_cached`` the pages such an entry
    holds and no row does: what the prefix cache cannot give back now, kept as a running count because the
    scheduler asks it several times a step. Page 0 is reserved (padding target) and is neither free nor
    used. Pure accounting: the arrays live in the layers."""

    def __init__(self, capacity: int = 0):
        self.capacity = max(1, capacity)  # pages the arrays are sized for (page 0 included)
        self.refs = [0] * self.capacity
        self.tree = [0] * self.capacity
        self.pinned = [0] * self.capacity
        self.free = list(range(self.capacity - 1, 0, -1))  # popped from the end: lowest ids first
        self.cached = 0
        self.pinned_cached = 0
        # Spare pages the arrays may hold beyond what is used after a growth (set from the free KV
        # budget: growth slack never takes memory the budget does not have); None: no limit.
        self.spare: int | None = None

    @property
    def used(self) -> int:
        """Pages held by anyone (rows or the prefix cache)."""
        return self.capacity - 1 - len(self.free)

    @property
    def row_pages(self) -> int:
        """Pages at least one row holds."""
        return self.used - self.cached

    def alloc(self, n: int) -> list[int]:
        """``n`` pages with one holder each; the capacity grows (geometrically) when too few are free."""
        if n > len(self.free):
            exact = self.capacity + n - len(self.free)
            new = max(int(self.capacity * _GROW), MIN_PAGES)
            if self.spare is not None:
                new = min(new, exact + self.spare)
            new = max(new, exact)
            self.refs += [0] * (new - self.capacity)
            self.tree += [0] * (new - self.capacity)
            self.pinned += [0] * (new - self.capacity)
            self.free = list(range(new - 1, self.capacity - 1, -1)) + self.free
            self.capacity = new
        pages = [self.free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        """One more row holds these (held) pages: a prefix it borrows from the prefix cache."""
        for p in pages:
            assert self.refs[p] or self.tree[p], f"page {p} borrowed while free"
            if not self.refs[p]:
                self.cached -= 1
                if self.pinned[p]:
                    self.pinned_cached -= 1
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refs[p] > 0, f"page {p} released more often than held"
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if self.tree[p]:
                    self.cached += 1
                    if self.pinned[p]:
                        self.pinned_cached += 1
                else:
                    self.free.append(p)

    def tree_retain(self, pages: list[int]) -> None:
        """A prefix-cache entry holds these (held) pages too."""
        for p in pages:
            assert self.refs[p] or self.tree[p], f"page {p} cached while free"
            self.tree[p] += 1

    def tree_release(self, pages: list[int]) -> None:
        for p in pages:
            assert self.tree[p] > 0, f"page {p} released by the prefix cache more often than held"
            self.tree[p] -= 1
            if self.tree[p] == 0 and self.refs[p] == 0:
                self.cached -= 1
                self.free.append(p)

    def pin(self, pages: list[int]) -> None:
        """A pinned prefix-cache entry holds these (tree-held) pages: they cannot be given back."""
        for p in pages:
            assert self.tree[p], f"page {p} pinned while the prefix cache does not hold it"
            self.pinned[p] += 1
            if self.pinned[p] == 1 and not self.refs[p]:
                self.pinned_cached += 1

    def unpin(self, pages: list[int]) -> None:
        for p in pages:
            assert self.pinned[p] > 0, f"page {p} unpinned more often than pinned"
            self.pinned[p] -= 1
            if self.pinned[p] == 0 and not self.refs[p]:
                self.pinned_cached -= 1

    def remap(self) -> dict[int, int]:
        """Renumber the used pages 1..used (the arrays are then gathered to match); returns old -> new."""
        live = [p for p in range(1, self.capacity) if self.refs[p] or self.tree[p]]
        mapping = {p: i + 1 for i, p in enumerate(live)}
        capacity = max(int((len(live) + 1) * _GROW), MIN_PAGES)
        refs, tree, pinned = [0] * capacity, [0] * capacity, [0] * capacity
        for p, q in mapping.items():
            refs[q], tree[q], pinned[q] = self.refs[p], self.tree[p], self.pinned[p]
        self.refs, self.tree, self.pinned, self.capacity = refs, tree, pinned, capacity
        self.free = list(range(capacity - 1, len(live), -1))
        return mapping


def pages_of(slots: np.ndarray) -> list[int]:
    """The distinct pages ``slots`` lie in, in order of first appearance."""
    return list(dict.fromkeys((slots // PAGE).tolist()))


def remap_slots(slots: np.ndarray, mapping: dict[int, int]) -> np.ndarray:
    if not len(slots):
        return slots
    pages = np.asarray([mapping[p] for p in (slots // PAGE).tolist()], dtype=np.int32)
    return pages * PAGE + slots % PAGE


_NO_SLOTS = np.zeros(0, dtype=np.int32)


class PageRow:
    """One row's pages and where its tokens sit in them. Its first ``len(borrowed)`` tokens are read from
    slots of pages the prefix cache holds (``borrowed``; read-only: the row holds one reference on each of
    their pages, ``borrowed_pages``); the rest, its own tokens, occupy the slots ``head .. head + own`` of
    its own pages, which only it writes."""

    __slots__ = ("pages", "head", "length", "borrowed", "borrowed_pages")

    def __init__(self):
        self.pages: list[int] = []
        self.head = 0
        self.length = 0
        self.borrowed = _NO_SLOTS
        self.borrowed_pages: list[int] = []

    @property
    def own(self) -> int:
        return self.length - len(self.borrowed)

    def borrow(self, slots: np.ndarray, pool: PagePool) -> None:
        """Start the (empty) row with tokens read from these slots of pages the prefix cache holds."""
        assert not self.length, "only an empty row borrows a prefix"
        if len(slots):
            self.borrowed = np.asarray(slots, dtype=np.int32)
            self.borrowed_pages = pages_of(self.borrowed)
            pool.retain(self.borrowed_pages)
            self.length = len(slots)

    def slots(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """The pool slots of tokens [start, end)."""
        end = self.length if end is None else end
        if end <= start:
            return np.zeros(0, dtype=np.int32)
        B = len(self.borrowed)
        if end <= B:
            return self.borrowed[start:end]
        own = self._own_slots(max(start, B) - B, end - B)
        return own if start >= B else np.concatenate([self.borrowed[start:], own])

    def slot(self, t: int) -> int:
        """The pool slot of token ``t`` (one token: :meth:`slots` without building arrays)."""
        B = len(self.borrowed)
        if t < B:
            return int(self.borrowed[t])
        k = self.head + t - B
        return self.pages[k // PAGE] * PAGE + k % PAGE

    def _own_slots(self, start: int, end: int) -> np.ndarray:
        first, last = (self.head + start) // PAGE, (self.head + end - 1) // PAGE + 1
        base = np.asarray(self.pages[first:last], dtype=np.int32)[:, None] * PAGE
        run = (base + np.arange(PAGE, dtype=np.int32)).ravel()
        a = self.head + start - first * PAGE
        return run[a : a + end - start]

    def pages_for(self, length: int) -> int:
        """Own pages the row needs at ``length`` tokens."""
        own = length - len(self.borrowed)
        return (self.head + own + PAGE - 1) // PAGE if own > 0 else 0

    def grow(self, pool: PagePool, n: int) -> None:
        """Room for ``n`` more tokens (pages allocated as needed); the length grows by n."""
        need = self.pages_for(self.length + n) - len(self.pages)
        if need > 0:
            self.pages += pool.alloc(need)
        self.length += n

    def truncate(self, n: int, pool: PagePool) -> None:
        """Forget the last ``n`` (own) tokens; pages left empty are freed."""
        assert n <= self.own, "a row never forgets borrowed tokens from the end"
        self.length -= n
        keep = self.pages_for(self.length)
        if keep < len(self.pages):
            pool.release(self.pages[keep:])
            del self.pages[keep:]
        if not self.own:
            self.head = 0

    def drop_front(self, n: int, pool: PagePool) -> None:
        """Forget the first ``n`` tokens (they are read from a shared prefix from now on)."""
        B = len(self.borrowed)
        if B:
            kept = self.borrowed[min(n, B):]
            pages = pages_of(kept)
            still = set(pages)
            pool.release([p for p in self.borrowed_pages if p not in still])
            self.borrowed, self.borrowed_pages = kept, pages
            self.length -= min(n, B)
            n -= min(n, B)
        if not n:
            return
        own = self.own - n
        self.head += n
        self.length -= n
        gone = self.head // PAGE if own else len(self.pages)
        if gone:
            pool.release(self.pages[:gone])
            del self.pages[:gone]
        self.head = self.head - gone * PAGE if own else 0

    def remap(self, mapping: dict[int, int]) -> None:
        self.pages = [mapping[p] for p in self.pages]
        self.borrowed = remap_slots(self.borrowed, mapping)
        self.borrowed_pages = [mapping[p] for p in self.borrowed_pages]

    def clear(self, pool: PagePool) -> None:
        pool.release(self.pages)
        pool.release(self.borrowed_pages)
        self.pages, self.head, self.length = [], 0, 0
        self.borrowed, self.borrowed_pages = _NO_SLOTS, []


class PagedSegment:
    """A prefix-cache entry's KV held by reference: slots of a lane's pool (one reference on each page
    they touch, counted in ``PagePool.tree``). Nothing is copied to make one: a row's own pages become
    the cache's when it is inserted, and a later row borrows them back (``PageRow.borrow``)."""

    __slots__ = ("lane", "slots", "pages", "pinned")

    def __init__(self, lane, slots: np.ndarray):  # lane: the kv_pages.PagedLaneKV whose pool holds the slots
        self.lane = lane
        self.slots = np.asarray(slots, dtype=np.int32)
        self.pages = pages_of(self.slots)
        self.pinned = False  # its radix node is pinned (PagePool.pinned counts its pages)
        lane.pool.tree_retain(self.pages)
        lane.segments.add(self)

    def __len__(self) -> int:
        return len(self.slots)

    def split(self, k: int) -> tuple["PagedSegment", "PagedSegment"]:
        """Two segments for the first ``k`` tokens and the rest; this one is released."""
        upper, lower = PagedSegment(self.lane, self.slots[:k]), PagedSegment(self.lane, self.slots[k:])
        self.release()
        return upper, lower

    def pin(self) -> None:
        if not self.pinned and self.lane is not None:
            self.lane.pool.pin(self.pages)
            self.pinned = True

    def unpin(self) -> None:
        if self.pinned and self.lane is not None:
            self.lane.pool.unpin(self.pages)
        self.pinned = False

    def release(self) -> None:
        if self.lane is not None:
            self.unpin()
            self.lane.pool.tree_release(self.pages)
            self.lane.segments.discard(self)
            self.lane = None

    def layers(self) -> list[tuple]:
        """Per layer (1, KH, n, D) keys and values (lazy gathers from the pool)."""
        return self.lane.read(self.slots)

    def cached_pages(self) -> int:
        """Pages of this segment no row holds."""
        refs = self.lane.pool.refs
        return sum(1 for p in self.pages if not refs[p])

    def remap(self, mapping: dict[int, int]) -> None:
        self.slots = remap_slots(self.slots, mapping)
        self.pages = [mapping[p] for p in self.pages]
