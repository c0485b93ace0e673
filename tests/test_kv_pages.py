"""The decode rows' paged KV (kv_pages): through any sequence of joins, decode steps, speculative
verifications that keep different counts per row, rows switching to a shared prefix, and rows leaving,

- every page's holder count equals the rows whose tables hold it, no page is in two rows, free + used
  pages = the pool, and the arrays are sized for the pool (also checked on the real scheduler by
  tests/test_kv_accounting.py);
- each row's RoPE position, the columns its queries attend to in the step's working set, and what
  ``row`` hands the radix tree are exactly its tokens, in order;
- the bytes held are the pool arrays', and an empty lane holds none.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
from parallm_engine.kv.kv_pages import PAGE, PagedLaneKV, PagedSegment, PagePool

H, D = 2, 8


def check_pages(kv: PagedLaneKV) -> None:
    """The page invariants of one lane: every page's row count equals the rows holding it (their own
    pages or a borrowed prefix) and its tree count the prefix-cache segments holding it; a page is
    written by at most one row (its own), so a page in two rows is a read-only borrowed prefix page;
    free + used = the pool and used = the rows' pages + the pages only the prefix cache holds. Rows are
    the running rows and the rows of prompts being prefilled. The running count of pinned pages only the
    cache holds (``PagePool.pinned_cached``, what ``RadixCache.pinned_bytes`` reads) equals a recount."""
    pool = kv.pool
    holders = [0] * pool.capacity
    owners = [0] * pool.capacity
    tree = [0] * pool.capacity
    pinned = [0] * pool.capacity
    for row in kv.rows + kv.pending:  # running rows and prompts' rows being prefilled (paged_prefill)
        assert row.pages_for(row.length) == len(row.pages) and 0 <= row.head < PAGE
        assert row.borrowed_pages == list(dict.fromkeys((row.borrowed // PAGE).tolist()))
        for p in row.pages:
            holders[p] += 1
            owners[p] += 1
        for p in row.borrowed_pages:  # read-only: a row keeps them even after the cache lets them go
            holders[p] += 1
    for seg in kv.segments:
        assert seg.lane is kv and seg.pages == list(dict.fromkeys((seg.slots // PAGE).tolist()))
        for p in seg.pages:
            tree[p] += 1
            pinned[p] += seg.pinned
    assert holders[0] == 0 and pool.refs[0] == 0 and pool.tree[0] == 0, "page 0 (padding) is never handed out"
    assert pool.refs == holders, "a page's holder count is not the rows holding it"
    assert pool.tree == tree, "a page's cache count is not the segments holding it"
    assert max(owners) <= 1, "a page is written by two rows"
    assert sorted(pool.free) == [p for p in range(1, pool.capacity) if not holders[p] and not tree[p]]
    cached = sum(1 for p in range(pool.capacity) if tree[p] and not holders[p])
    assert pool.cached == cached, "pages only the cache holds are miscounted"
    assert pool.pinned == pinned, "a page's pin count is not the pinned segments holding it"
    pinned_cached = sum(1 for p in range(pool.capacity) if pinned[p] and not holders[p])
    assert pool.pinned_cached == pinned_cached, "pinned pages only the cache holds are miscounted (running count)"
    assert pool.used + len(pool.free) + 1 == pool.capacity
    assert pool.used == pool.row_pages + pool.cached
    for layer in kv.layers:
        assert layer.keys is None or layer.keys.shape[1] == pool.capacity * PAGE
    assert kv.nbytes() == sum(0 if la.keys is None else la.keys.nbytes + la.values.nbytes for la in kv.layers)


def _kv(tags: list[float]) -> mx.array:
    """(1, H, n, D) keys whose token t is tags[t] everywhere (position-identifying values)."""
    a = np.broadcast_to(np.array(tags, np.float32)[None, None, :, None], (1, H, len(tags), D))
    return mx.array(a.copy())


_OPS = st.lists(st.one_of(
    st.tuples(st.just("join"), st.lists(st.integers(0, 20), min_size=1, max_size=3)),
    st.tuples(st.just("step"), st.integers(1, 4)),  # that many plain decode steps in a row (the kept working set)
    st.tuples(st.just("verify"), st.lists(st.integers(0, 5), min_size=6, max_size=6)),
    # a ragged step: row i verifies its own number of positions (speculative.verify's forward_ragged)
    st.tuples(st.just("ragged"), st.lists(st.integers(0, 15), min_size=6, max_size=6)),
    st.tuples(st.just("drop"), st.lists(st.integers(0, 9), min_size=1, max_size=4)),
    st.tuples(st.just("share"), st.integers(0, 9)),
    # the prefix cache: hold a row's tokens [a, b) by reference, release or split an entry, and a new
    # row that borrows an entry's tokens and adds its own
    st.tuples(st.just("cache"), st.tuples(st.integers(0, 9), st.integers(0, 40), st.integers(1, 40))),
    st.tuples(st.just("uncache"), st.integers(0, 9)),
    st.tuples(st.just("split"), st.tuples(st.integers(0, 9), st.integers(1, 40))),
    st.tuples(st.just("borrow"), st.tuples(st.integers(0, 9), st.integers(0, 12))),
), min_size=1, max_size=18)


@settings(max_examples=120, deadline=None)
@given(first=st.lists(st.integers(0, 30), min_size=1, max_size=4), ops=_OPS, P=st.sampled_from([0, 5, 11]))
def test_rows_read_exactly_their_tokens_and_pages_are_held_once(first, ops, P):
    layers = 2
    kv = PagedLaneKV(layers)
    tag = iter(range(1, 10**6))
    prefix = [-1000.0 + t for t in range(P)]
    if P:
        kv.set_shared([(_kv(prefix), _kv(prefix) + 0.5)] * layers)
    expect: list[list[float]] = []  # each row's whole sequence (the shared prefix included if it uses it)
    cached: list[tuple] = []  # prefix-cache entries: (PagedSegment, the tokens it holds)

    def join(lengths, mode):
        """mode 0: rows of their own tokens; 1: rows continuing the shared prefix (storing only their
        own tokens); 2: rows holding the prefix's tokens themselves (they may switch: "share")."""
        rows = []
        for n in lengths:
            tags = [float(next(tag)) for _ in range(n)]
            stored = (prefix if mode == 2 else []) + tags
            x = _kv(stored) if stored else None
            rows.append((x, None if x is None else x + 0.5))
            expect.append((prefix if mode else []) + tags)
        kv.add([rows] * layers, [mode == 1] * len(rows))

    join(first, 0)
    for op, arg in ops:
        if op == "join":
            join(arg, arg[0] % 3 if P else 0)
        elif op in ("step", "verify") and expect:
            for _ in range(arg if op == "step" else 1):
                W = 1 if op == "step" else 4
                new = [[float(next(tag)) for _ in range(W)] for _ in expect]
                x = mx.array(np.broadcast_to(np.array(new, np.float32)[:, None, :, None], (len(new), H, W, D)).copy())
                before = [len(e) for e in expect]
                kv.begin(W)
                for layer in kv.layers:
                    assert np.array(layer.offset).tolist() == before  # RoPE: each row's own position
                    mask = layer.make_mask(W)  # built before the write, as the models do
                    keys, values = layer.update_and_fetch(x, x + 0.5)
                    assert np.array(layer.offset).tolist() == [b + W for b in before]
                keys, values = np.array(keys), np.array(values)
                T = keys.shape[2]
                for r, e in enumerate(expect):
                    own = e[P:] if kv.shared_rows[r] else e
                    for q in range(W):  # query q sees the row's own tokens up to its new position q
                        seen = np.ones(T, bool) if mask is None else np.array(mask)[r, 0, q]
                        cols = [c for c in range(T) if seen[c]]
                        np.testing.assert_array_equal(keys[r, 1, cols, 3], own + new[r][: q + 1])
                        np.testing.assert_array_equal(values[r, 0, cols, 0], np.array(own + new[r][: q + 1]) + 0.5)
                if op == "step":
                    keeps = [1] * len(expect)
                else:
                    keeps = [arg[i % len(arg)] % (W + 1) for i in range(len(expect))]
                    kv.rollback_rows(W, keeps)
                for e, n, k in zip(expect, new, keeps):
                    e.extend(n[:k])
        elif op == "ragged" and expect:
            widths = [1 + arg[i % len(arg)] % 4 for i in range(len(expect))]
            keeps = [arg[i % len(arg)] // 4 % (w + 1) for i, w in enumerate(widths)]
            new = [[float(next(tag)) for _ in range(w)] for w in widths]
            flat = [t for n in new for t in n]  # one model row per position, row by row
            x = mx.array(np.broadcast_to(np.array(flat, np.float32)[:, None, None, None], (len(flat), H, 1, D)).copy())
            before = [len(e) for e in expect]
            kv.begin(widths)
            W = max(widths)
            rag = kv.layers[0].ragged
            assert rag is not None and rag.width == W
            cells = np.array(rag.cells).tolist()
            assert np.array(rag.fill)[cells].tolist() == list(range(len(flat)))
            for layer in kv.layers:
                # RoPE: each model row at its own position (row i's j-th new token: before_i + j)
                assert np.array(layer.offset).tolist() == [b + j for b, w in zip(before, widths) for j in range(w)]
                keys, values = layer.update_and_fetch(x, x + 0.5)
            keys, values = np.array(keys), np.array(values)
            mask = np.ones((len(expect), 1, W, keys.shape[2]), bool) if rag.mask is None else np.array(rag.mask)
            T = keys.shape[2]
            p = 0
            for r, e in enumerate(expect):
                own = e[P:] if kv.shared_rows[r] else e
                for q in range(widths[r]):  # the row's cell for its q-th position sees up to it
                    cell = cells[p]
                    assert divmod(cell, W) == (r, W - widths[r] + q)
                    cols = [c for c in range(T) if mask[r, 0, cell % W, c]]
                    np.testing.assert_array_equal(keys[r, 1, cols, 3], own + new[r][: q + 1])
                    np.testing.assert_array_equal(values[r, 0, cols, 0], np.array(own + new[r][: q + 1]) + 0.5)
                    p += 1
            kv.rollback_rows(widths, keeps)
            assert kv.layers[0].ragged is None
            for e, n, k in zip(expect, new, keeps):
                e.extend(n[:k])
        elif op == "drop" and expect:
            gone = {i % len(expect) for i in arg}
            keep = [i for i in range(len(expect)) if i not in gone]
            kv.keep(keep)
            expect = [expect[i] for i in keep]
        elif op == "share" and P and expect:
            r = arg % len(expect)
            if not kv.shared_rows[r] and expect[r][:P] == prefix:
                kv.share_rows([r])  # a row that holds the prefix bitwise switches to the shared copy
        elif op == "cache" and expect:
            r, a, n = arg[0] % len(expect), arg[1], arg[2]
            stored = expect[r][P:] if kv.shared_rows[r] else expect[r]
            a = min(a, max(len(stored) - 1, 0))
            b = min(a + n, len(stored))
            if b > a:
                cached.append((PagedSegment(kv, kv.rows[r].slots(a, b)), stored[a:b]))
        elif op == "uncache" and cached:
            seg, _ = cached.pop(arg % len(cached))
            seg.release()
        elif op == "split" and cached:
            i = arg[0] % len(cached)
            seg, tags = cached[i]
            if len(tags) > 1:
                k = 1 + arg[1] % (len(tags) - 1)
                upper, lower = seg.split(k)
                cached[i : i + 1] = [(upper, tags[:k]), (lower, tags[k:])]
        elif op == "borrow" and cached:
            seg, tags = cached[arg[0] % len(cached)]
            own = [float(next(tag)) for _ in range(arg[1])]
            x = _kv(own) if own else None
            kv.add([[(x, None if x is None else x + 0.5)]] * layers, [False], [seg.slots])
            expect.append(tags + own)
        check_pages(kv)
        for seg, tags in cached:  # an entry reads its tokens whatever the rows did since
            for k, v in seg.layers():
                np.testing.assert_array_equal(np.array(k)[0, 1, :, 0], tags)
                np.testing.assert_array_equal(np.array(v)[0, 0, :, 3], np.array(tags) + 0.5)
        assert kv.positions() == [len(e) for e in expect]
        for r, e in enumerate(expect):
            if e:
                per_layer = kv.row(r, 0, len(e))
                for k, v in per_layer:
                    np.testing.assert_array_equal(np.array(k)[0, 1, :, 2], e)
                    np.testing.assert_array_equal(np.array(v)[0, 0, :, 0], np.array(e) + 0.5)
                if len(e) > 2:
                    k, _ = kv.row(r, 1, len(e) - 1)[1]
                    np.testing.assert_array_equal(np.array(k)[0, 0, :, 1], e[1:-1])
    kv.keep([])
    check_pages(kv)
    assert kv.pool.used == kv.pool.cached  # what is left is the prefix cache's
    for seg, _ in cached:
        seg.release()
    kv.trim()
    check_pages(kv)
    assert kv.nbytes() == 0  # an idle lane holds nothing


def test_a_long_row_joining_costs_its_own_pages_only():
    """Short rows and one long row: the lane holds the rows' own pages, not every row as long as the
    longest (the left-padded layout's cost)."""
    kv = PagedLaneKV(1)
    kv.add([[(_kv([1.0] * 10), _kv([1.0] * 10)) for _ in range(8)]])
    kv.add([[(_kv([2.0] * 3000), _kv([2.0] * 3000))]])
    need = 8 * -(-10 // PAGE) + -(-3000 // PAGE) + 1
    assert kv.pool.used + 1 == need
    assert kv.pool.capacity <= 1.3 * need  # growth slack only
    assert kv.pages_after(0) == need and kv.pages_after(PAGE) == need + 9
    kv.pool.spare = 0  # no free budget: the arrays grow to exactly what the rows need
    before, free = kv.pool.capacity, len(kv.pool.free)
    n = (free + 5) * PAGE
    kv.add([[(_kv([3.0] * n), _kv([3.0] * n))]])
    assert kv.pool.capacity == before + 5 and not kv.pool.free
    check_pages(kv)
    kv.keep(list(range(8)))  # the long rows leave: the pool shrinks back
    check_pages(kv)
    assert kv.pool.capacity <= 2 * (8 * -(-10 // PAGE) + 1)


def test_page_pool_accounting():
    pool = PagePool()
    a = pool.alloc(3)
    b = pool.alloc(100)  # grows
    assert 0 not in a + b and len(set(a + b)) == 103
    assert pool.used == 103
    pool.release(a + b)
    assert pool.used == 0 and len(pool.free) == pool.capacity - 1
    with pytest.raises(AssertionError):
        pool.release(a)


def test_engine_stats_and_metrics_report_the_pages(tiny_engine):
    """While rows decode, ``Engine.stats()`` and ``/metrics`` report the pages they hold (each row its own
    length rounded up to a page); when they finish, their pages are the prefix cache's."""
    from parallm_engine.serve import metrics

    vocab = tiny_engine.model_info.vocab_size
    prompts = [[(7 * i + j) % (vocab - 10) + 5 for j in range(20 + 9 * i)] for i in range(3)]
    handles = [tiny_engine.submit(p, max_tokens=40, temperature=0, ignore_eos=True) for p in prompts]
    streams = [iter(h) for h in handles]
    for s in streams:
        next(s)

    def snapshot():
        sched = tiny_engine._scheduler
        rows = [r for lane in sched.batch.lanes for r in lane.kv.rows]
        held = {p for r in rows for p in [*r.pages, *r.borrowed_pages]}
        return sched.memory_stats(), len(held), len(rows)

    stats, held, rows = tiny_engine.run_on_engine_thread(snapshot)
    # (the engine is shared with other tests: its prefix cache may hold pages of theirs)
    assert rows and stats["kv_pages_used"] - stats["kv_pages_cached"] == held > 0
    assert stats["kv_page_tokens"] == PAGE
    page = metrics.render(tiny_engine.stats(), None, "tiny")
    assert "parallm_kv_pages_used" in page
    for h in handles:
        tiny_engine._collect(h)
    stats, held, rows = tiny_engine.run_on_engine_thread(snapshot)
    # the rows' pages stay as the prefix cache's (held by reference, not copied)
    assert rows == 0 and stats["kv_pages_used"] == stats["kv_pages_cached"] > 0


def test_a_row_joins_the_running_lane_that_holds_its_prefix(tiny_engine):
    """With two decode lanes, a request whose prefix the prefix cache holds in lane 1's pool joins lane 1
    (which has room) rather than the first lane with room, and borrows those pages instead of storing a
    copy; its tokens equal the same request alone."""
    from parallm_engine.core.request import Channel, Request
    from parallm_engine.sampling.sampling_params import SamplingParams
    from parallm_engine.core.scheduler import Scheduler, SchedulerConfig
    from parallm_engine.core.stats import EngineStats

    from .model_zoo import prompt_ids

    vocab = tiny_engine.model_info.vocab_size
    config = SchedulerConfig(decode_lanes=2, cpu_kernels=tiny_engine.backend.cpu_kernels, step_time_target_s=0.0)
    sched = Scheduler(tiny_engine.model, tiny_engine.tokenizer, tiny_engine.model_info, config, EngineStats())
    sched.batch.fill_rows = 3

    def submit(ids, max_tokens):
        req = Request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), Channel())
        sched.add(req)
        return req

    def step_until(done):
        for _ in range(500):
            if done():
                return
            sched.step()
        raise AssertionError("the scheduler did not get there")

    lanes = sched.batch.lanes
    a, b, x = (submit(prompt_ids(40, vocab, seed=s), n) for s, n in ((1, 3), (2, 80), (3, 80)))
    step_until(lambda: len(lanes[0].seqs) == 3)
    c_ids = prompt_ids(40, vocab, seed=4)
    c, d = submit(c_ids, 3), submit(prompt_ids(40, vocab, seed=5), 80)
    step_until(lambda: a.finished and c.finished)
    assert len(lanes[0].seqs) == 2 and len(lanes[1].seqs) == 1  # room in both; c's pages cached in lane 1's pool
    follow = c_ids + c.result.choices[0].token_ids + prompt_ids(12, vocab, seed=6)
    c2 = submit(follow, 6)
    step_until(lambda: any(s.request is c2 for s in sched.running))
    row = lanes[1].kv.rows[[s.request for s in lanes[1].seqs].index(c2)]
    assert len(row.borrowed) >= 32  # read from the pages c left to the prefix cache (not copied)
    check_pages(lanes[1].kv)
    step_until(lambda: not sched.has_work() or all(r.finished for r in (b, x, d, c2)))
    want = tiny_engine.generate([follow], max_tokens=6, temperature=0, ignore_eos=True)[0].token_ids
    assert c2.result.choices[0].token_ids == want


def _steps(kv: PagedLaneKV, rows: list[list[float]], n: int) -> list[np.ndarray]:
    """``n`` plain decode steps of every row (new token tags after the last); each step's keys as fetched."""
    out = []
    for _ in range(n):
        new = [e[-1] + 1000.0 for e in rows]
        x = mx.array(np.broadcast_to(np.array(new, np.float32)[:, None, None, None], (len(new), H, 1, D)).copy())
        kv.begin(1)
        for layer in kv.layers:
            keys, _ = layer.update_and_fetch(x, x + 0.5)
        out.append(np.array(keys))
        for e, t in zip(rows, new):
            e.append(t)
    return out


def test_the_decode_working_set_is_kept_and_equals_the_gather():
    """Plain decode steps of the same rows append one column to the kept working set (decode_working_set)
    instead of gathering it: the keys attention gets are the gathered ones, step by step; a row leaving
    drops it (the next step gathers, the one after rebuilds, then appends again)."""
    def run(enabled: bool):
        kv = PagedLaneKV(2)
        kv.ws.enabled = enabled  # the engine's decode_working_set option (DecodeBatch sets it per lane)
        rows = [[float(10 * r + t) for t in range(n)] for r, n in enumerate((3, 9, 14))]
        kv.add([[(_kv(e), _kv(e) + 0.5) for e in rows]] * 2)
        got = _steps(kv, rows, 6)
        kv.keep([0, 2])
        rows = [rows[0], rows[2]]
        got += _steps(kv, rows, 5)
        return got, kv.ws

    kept, ws = run(True)
    gathered, off = run(False)
    assert len(kept) == len(gathered)
    for a, b in zip(kept, gathered):
        np.testing.assert_array_equal(a, b)
    assert ws.appends == 7 and ws.rebuilds == 2  # 4 + 3 appends; one rebuild per stable stretch
    assert off.appends == off.rebuilds == 0


def test_append_steps_leave_the_pool_write_to_one_flush():
    """An append step writes its column only into the kept arrays (decode_working_set); the pool takes all the
    appended columns in one scatter per array when the lane is next read or changed (a prefix-cache entry
    read, a row leaving): each token's KV is written once, and what is read is exactly the rows' tokens."""
    kv = PagedLaneKV(2)
    rows = [[float(10 * r + t) for t in range(n)] for r, n in enumerate((3, 9, 14))]
    kv.add([[(_kv(e), _kv(e) + 0.5) for e in rows]] * 2)
    _steps(kv, rows, 2)  # a gather, then a rebuild (its column written to the pool, the arrays gathered)
    written = kv.meter.written
    _steps(kv, rows, 5)
    five = 3 * 5 * H * D * 4 * 2 * 2  # rows x columns x heads x D x float32 bytes x (keys, values) x layers
    assert kv.ws.appends == 5 and kv.meter.written == written + five  # counted once, as the arrays take them
    assert all(layer.ws_pending[1] - layer.ws_pending[0] == 5 for layer in kv.layers)
    newest = mx.array(kv.rows[1].slots(len(rows[1]) - 5, len(rows[1])))
    assert not np.array_equal(np.array(kv.layers[0].keys[1, newest, 0]), rows[1][-5:])  # not in the pool yet
    check_pages(kv)  # the arrays still have the pool's size
    held = list(rows[1])
    seg = PagedSegment(kv, kv.rows[1].slots(0, len(held)))  # the prefix cache takes a row's pages
    for k, v in seg.layers():  # reading them writes the columns first
        np.testing.assert_array_equal(np.array(k)[0, 1, :, 0], held)
        np.testing.assert_array_equal(np.array(v)[0, 0, :, 3], np.array(held) + 0.5)
    np.testing.assert_array_equal(np.array(kv.layers[0].keys[1, newest, 0]), rows[1][-5:])
    assert kv.meter.written == written + five  # not counted again
    assert all(a == b for a, b in (layer.ws_pending for layer in kv.layers))
    _steps(kv, rows, 3)  # appending goes on after the flush
    assert kv.ws.appends == 8
    kv.keep([0, 2])  # a row leaving: the 3 new columns go to the pool first
    assert kv.meter.written == written + five * 8 // 5
    for r, e in enumerate((rows[0], rows[2])):
        for k, v in kv.row(r, 0, len(e)):
            np.testing.assert_array_equal(np.array(k)[0, 1, :, 2], e)
            np.testing.assert_array_equal(np.array(v)[0, 0, :, 0], np.array(e) + 0.5)
    for k, _ in seg.layers():  # the cache's entry outlives its row
        np.testing.assert_array_equal(np.array(k)[0, 1, :, 0], held)
    seg.release()
    check_pages(kv)


def test_the_decode_working_set_stays_within_its_limit():
    kv = PagedLaneKV(2)
    rows = [[float(t) for t in range(20)] for _ in range(4)]
    kv.add([[(_kv(e), _kv(e) + 0.5) for e in rows]] * 2)
    kv.ws.limit = 1  # no room: every step gathers, nothing is kept
    _steps(kv, rows, 4)
    assert kv.ws.appends == kv.ws.rebuilds == 0 and all(layer.ws is None for layer in kv.layers)
    kv.ws.limit = None
    _steps(kv, rows, 3)
    assert kv.ws.rebuilds == 1 and kv.ws.appends == 2
    assert kv.ws.nbytes(kv.layers) == 2 * 2 * 4 * H * kv.ws.capacity * D * 4  # layers x (K, V) x rows, float32
    kv.keep([])
    assert kv.ws.nbytes(kv.layers) == 0  # an idle lane keeps none
