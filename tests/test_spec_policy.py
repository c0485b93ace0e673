"""The adaptive speculative width (spec_policy): from measured step costs and each row's acceptance rate,
speculate as wide as pays, not at all where the machine is compute-bound; and in the engine, adaptive
rows follow what the costs say while the output stays the plain greedy output."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallm_engine.spec.spec_policy import (BACKOFF, GROWTH, MIN_GAIN, SPAN, WINDOW, RealizedGain, StepCost,
                                        batch_positions, batch_tokens, choose_width, expected_tokens, run_odds)

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _costs(fn, rows=SIZES, top: int = 256) -> StepCost:
    """A StepCost that has measured (three times each) plain steps of every batch size in ``rows`` and
    speculative steps of every half-octave of positions above it, up to ``top``: seconds = fn(positions)."""
    cost = StepCost()
    for b in rows:
        for _ in range(3):
            cost.observe_plain(b, fn(b))
        p = b + 1
        while p <= top:
            for _ in range(3):
                cost.observe(b, p, fn(p))
            p = max(p + 1, int(p * 1.2))
    return cost


def test_expected_tokens_is_the_accepted_run_plus_one():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0, rel=0.01)


def test_bursty_acceptance_is_a_first_rate_and_a_continuation_rate():
    """A copying row that accepted its first draft mostly accepts the next: its later drafts are worth
    more than rate^j (measured on the copy-heavy bench: P(first) 0.83, then 0.90 and 0.88)."""
    assert run_odds(0.8, 3, 0.9) == pytest.approx([0.8, 0.72, 0.648])
    assert run_odds(0.5, 3) == pytest.approx([0.5, 0.25, 0.125])  # no continuation rate: independent
    assert expected_tokens(0.8, 3, 0.9) == pytest.approx(1 + 0.8 + 0.72 + 0.648)
    assert batch_tokens([(0.8, 3, 0.9), (0.5, 2)], 3) == pytest.approx(expected_tokens(0.8, 3, 0.9) + 1.75)


def test_a_batch_expects_the_sum_of_its_rows_runs_and_pays_for_its_own_positions():
    """Every row emits its own accepted run (rows end at different columns), so a row that accepts
    little does not hold the others back; and a ragged step computes each row's own positions only."""
    assert batch_tokens([(0.5, 3)], 3) == pytest.approx(expected_tokens(0.5, 3))
    assert batch_tokens([(0.9, 4), (0.9, 0)], 4) == pytest.approx(expected_tokens(0.9, 4) + 1)
    assert batch_tokens([(0.9, 4), (0.9, 1)], 2) == pytest.approx(expected_tokens(0.9, 2) + expected_tokens(0.9, 1))
    assert batch_tokens([(0.7, 4)] * 32, 4) == pytest.approx(32 * expected_tokens(0.7, 4))
    assert batch_positions([(0.9, 4), (0.0, 0), (0.5, 1)], 3) == 4 + 1 + 2
    flat = _costs(lambda p: 0.05 + 0.0001 * p)  # positions nearly free
    assert choose_width(flat, [(0.7, 4)] * 32, 256) > 1
    linear = _costs(lambda p: 0.01 * p)  # compute-bound: 32 rows at 0.7 do not pay for a second position
    assert choose_width(linear, [(0.7, 4)] * 32, 256) == 1


def test_memory_bound_machine_speculates_wide_and_compute_bound_not_at_all():
    flat = _costs(lambda p: 0.05)  # reading the weights dominates: positions are free
    linear = _costs(lambda p: 0.01 * p)  # compute-bound: every position costs as much as a row
    rows = [(0.9, 8)] * 4
    assert choose_width(flat, rows, 256) == 9  # as wide as the rows' drafts go
    assert choose_width(linear, rows, 256) == 1
    # Rows that accept little do not pay for even free-ish positions beyond the gain margin.
    assert choose_width(_costs(lambda p: 0.05 + 0.01 * p), [(0.05, 8)], 256) == 1
    # The budget of positions caps the width.
    assert choose_width(flat, rows, 16) == 4
    # Rows that do not draft cost one position each: one copying row among seven that do not speculates
    # where positions are free.
    assert choose_width(flat, [(0.9, 8)] + [(0.0, 0)] * 7, 256) == 9


def test_costs_are_learnt_by_running_upwards():
    cost = StepCost()
    assert choose_width(cost, [(1.0, 4)], 256) == 1  # a plain step of this batch size is measured first
    cost.observe_plain(1, 0.05)
    # Optimistic: nothing speculative measured, so a step as dear as a plain one, up to GROWTH x its size.
    assert cost.estimate(1, 2) == 0.05 and cost.estimate(1, 3) is None
    assert choose_width(cost, [(1.0, 4)], 256) == GROWTH
    cost.observe(1, 2, 0.06)
    assert choose_width(cost, [(1.0, 4)], 256) == 4  # flat from what is measured, up to GROWTH x it
    cost.observe(1, 4, 0.16)  # dear: the line through 2 and 4 says 3 costs 0.11, 5 (past the span) stays flat
    assert cost.estimate(1, 3) == pytest.approx(0.11)
    assert choose_width(cost, [(1.0, 4)], 256) == 2
    # Once the measured sizes span SPAN positions the line is followed past them.
    cost = StepCost()
    cost.observe_plain(8, 0.05)
    cost.observe(8, 10, 0.07)
    cost.observe(8, 10 + SPAN, 0.07 + 0.002 * SPAN)
    assert cost.estimate(8, 30) == pytest.approx(0.07 + 0.002 * 20)


def test_step_costs_resist_a_slow_step_and_are_kept_per_batch_size():
    """A step slowed by something else (another thread, a page pool growing: one measured 5x its size)
    must not set what a size costs; and verifying 24 positions of 8 rows is not a plain step of 24 rows."""
    cost = StepCost()
    cost.observe_plain(8, 0.05)
    cost.observe(8, 24, 0.4)  # the first step of this size was slowed
    cost.observe(8, 24, 0.08)
    assert cost.estimate(8, 24) == pytest.approx(0.08)  # the least while there are fewer than three
    cost.observe(8, 24, 0.09)
    cost.observe(8, 24, 0.085)
    assert cost.estimate(8, 24) == pytest.approx(0.085)  # then the median
    cost.observe_plain(24, 0.15)
    assert cost.plain_seconds(24) == 0.15 and cost.estimate(8, 24) == pytest.approx(0.085)
    assert cost.plain_seconds(1) is None and cost.estimate(1, 2) is None


@settings(max_examples=60, deadline=None)
@given(per_row=st.floats(0.001, 1.0), fixed=st.floats(0.0, 1.0), rate=st.floats(0.0, 1.0),
       cont=st.floats(0.0, 1.0), batch=st.integers(1, 64), cap=st.integers(0, 16))
def test_the_chosen_width_never_promises_less_than_a_plain_step(per_row, fixed, rate, cont, batch, cap):
    cost = _costs(lambda p: fixed + per_row * p, rows=(batch,))
    rows = [(rate, cap, cont)] * batch
    w = choose_width(cost, rows, 256)
    assert 1 <= w <= max(1, min(cap + 1, 256 // batch))
    if w > 1:
        tokens = batch_tokens(rows, w - 1)
        plain = batch / cost.plain_seconds(batch)
        assert tokens / cost.estimate(batch, batch_positions(rows, w - 1)) > plain * MIN_GAIN - 1e-9


def test_a_batch_size_whose_speculation_delivered_less_backs_off_doubling():
    cost = _costs(lambda p: 0.1)  # a plain step of 8 rows: 80 tok/s
    gain = RealizedGain()
    for _ in range(WINDOW):  # 8 rows, 6 tokens per 0.1 s step: 60 tok/s, a loss
        assert gain.allows(8)
        gain.observe(8, 6, 0.1, cost)
    assert sum(not gain.allows(8) for _ in range(BACKOFF)) == BACKOFF
    assert gain.allows(8) and gain.allows(1)  # the backoff is over; other batch sizes never stopped
    for _ in range(WINDOW):
        gain.observe(8, 6, 0.1, cost)
    assert sum(not gain.allows(8) for _ in range(4 * BACKOFF)) == 2 * BACKOFF  # lost again: twice as long
    for _ in range(WINDOW):  # 16 tokens per step: 160 tok/s, a win, and the next loss backs off 32 again
        gain.observe(8, 16, 0.1, cost)
    assert gain.allows(8)
    for _ in range(WINDOW):
        gain.observe(8, 6, 0.1, cost)
    assert sum(not gain.allows(8) for _ in range(4 * BACKOFF)) == BACKOFF


# -- in the engine -------------------------------------------------------------------------------
class GivenCosts(StepCost):
    """Step costs fixed by the test (the engine's measurements are ignored): what a machine of that
    kind would have measured, seconds = fn(positions)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def observe(self, rows, positions, seconds):
        pass

    def observe_plain(self, rows, seconds):
        pass

    def plain_seconds(self, rows):
        return self.fn(rows)

    def estimate(self, rows, positions):
        return self.fn(positions)


def _copy_prompts(engine, n):
    from parallm_bench.spec import copy_prompts

    return copy_prompts(engine, n, seed=5)  # JSON edits and quoted tool results: most drafts are accepted


def test_adaptive_rows_speculate_where_positions_are_free_and_not_where_they_cost(engine):
    sched = engine._scheduler
    spec = {"method": "ngram", "num_tokens": 6}  # adaptive (the default)
    prompts = _copy_prompts(engine, 1) * 4  # rows that accept alike (a batch advances by its least)
    plain = [r.token_ids for r in engine.generate(prompts, max_tokens=40, temperature=0)]
    saved = sched.speculator.cost
    try:
        # A flat cost, and slow enough that what speculation really delivers here beats it (RealizedGain).
        sched.speculator.cost = GivenCosts(lambda p: 0.5)
        free = engine.generate(prompts, max_tokens=40, temperature=0, speculative=spec)
        sched.speculator.cost = GivenCosts(lambda p: 0.01 * p)
        costly = engine.generate(prompts, max_tokens=40, temperature=0, speculative=spec)
    finally:
        sched.speculator.cost = saved
    assert [r.token_ids for r in free] == plain == [r.token_ids for r in costly]
    assert sum(r.usage.spec_accepted_tokens for r in free) > 20
    assert sum(r.usage.spec_proposed_tokens for r in costly) == 0


def test_the_engine_measures_its_steps(engine):
    engine.generate(_copy_prompts(engine, 2), max_tokens=24, temperature=0, ignore_eos=True)
    cost = engine.run_on_engine_thread(lambda: engine._scheduler.speculator.cost)
    assert cost.plain_seconds(2) > 0


def test_rows_of_a_batch_keep_their_own_runs(engine):
    """Each row emits its whole accepted run whatever the others accepted (rows end at different KV
    columns), and after every speculative step each unfinished row's KV holds all its context but its
    last token: nothing is left to recompute. The tokens are the plain ones."""
    sched = engine._scheduler
    spec = sched.speculator
    prompts = _copy_prompts(engine, 4)  # JSON edits and tool-result summaries: they accept differently
    plain = [r.token_ids for r in engine.generate(prompts, max_tokens=40, temperature=0)]
    behind, widths, uneven = [], [], []
    verify = spec.verify

    def checked(sched_, running, drafts):
        before = [len(s.output_ids) for s in running]
        out = verify(sched_, running, drafts)
        widths.append(out[0] / len(running))  # positions per row (rows verify their own: ragged)
        live = [s for s in running if s.finish_reason is None]
        behind.extend(s.total_len - s.computed for s in live)
        emitted = {len(s.output_ids) - b for s, b in zip(running, before) if s.finish_reason is None}
        uneven.append(len(emitted) > 1)
        return out

    spec.verify = checked
    try:
        got = engine.generate(prompts, max_tokens=40, temperature=0,
                              speculative={"method": "ngram", "num_tokens": 4, "adaptive": False})
    finally:
        del spec.verify
    assert [r.token_ids for r in got] == plain
    assert widths and max(widths) <= 5 and set(behind) == {1}
    assert any(uneven)  # some step's rows emitted different numbers of tokens
