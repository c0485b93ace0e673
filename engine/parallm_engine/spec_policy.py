"""How wide a speculative step should be, from what steps are measured to cost on this machine.

Verifying drafts costs positions: one forward over every row's 1 + k positions (the batch is
rectangular, so B rows at width W compute B x W positions whatever each row drafted). Whether that pays
depends on the hardware, not on a constant: where a decode step is bound by reading the weights (Apple
silicon, GPUs, a CPU at batch 1) extra positions are nearly free; where it is bound by compute (a CPU at
batch 32) each costs about as much as a row. So the scheduler times its steps and :class:`StepCost`
keeps seconds per step by the positions it computed (half-octave buckets); :func:`choose_width`
then picks the width whose expected tokens per second beats a plain step's, with each row's recent
acceptance rate giving its expected tokens (a row accepting a fraction r of its drafts emits
1 + r + ... + r^k tokens for k drafts). Every row of a batch emits its own accepted run (rows keep
different numbers of positions: ``kv_pages.PagedLaneKV.rollback_rows``), so the batch's expectation is the
sum of its rows' (:func:`batch_tokens`).

An unmeasured size is extrapolated from the measured ones below it (flat from a single one), and only
the smallest unmeasured width is ever tried, so sizes are learnt one at a time by running them: a batch
that is compute-bound loses one step learning that a wider one costs more, then stops speculating.
"""

from __future__ import annotations

import math

#: Weight of a new observation in a bucket's running average.
_ALPHA = 0.3
#: A speculative width must promise this much more throughput than a plain step (noise, and a verify
#: step cannot overlap the host's work with the device's as a plain pipelined step does: measured, but
#: the measurement is noisy).
MIN_GAIN = 1.1


def _bucket(positions: int) -> int:
    return round(2 * math.log2(positions))  # half-octaves: 1, 2, 3, 4, 5-6, 7-9, 10-13, 14-19, ...


class StepCost:
    """Seconds per decode step (forward, sampling, delivery) by the positions its forward computed."""

    def __init__(self):
        self.seconds: dict[int, float] = {}  # bucket -> running average of the step's seconds
        self.positions: dict[int, float] = {}  # bucket -> running average of its steps' positions

    def observe(self, positions: int, seconds: float) -> None:
        if positions <= 0 or seconds <= 0:
            return
        b = _bucket(positions)
        if b not in self.seconds:
            self.seconds[b], self.positions[b] = seconds, float(positions)
        else:
            self.seconds[b] = (1 - _ALPHA) * self.seconds[b] + _ALPHA * seconds
            self.positions[b] = (1 - _ALPHA) * self.positions[b] + _ALPHA * positions

    def known(self, positions: int) -> bool:
        return _bucket(positions) in self.seconds

    def estimate(self, positions: int) -> float | None:
        """Seconds for a step of ``positions``: its bucket's average; unmeasured, extrapolated along
        the line through the two largest measured sizes below it (a compute-bound machine's cost then
        grows as it measured), or the one measured size below (flat: optimistic, so it gets tried).
        None when nothing at or below it is measured."""
        b = _bucket(positions)
        if b in self.seconds:
            return self.seconds[b]
        below = sorted(k for k in self.seconds if k < b)
        if not below:
            return None
        hi = below[-1]
        if len(below) == 1:
            return self.seconds[hi]
        lo = below[-2]
        dp = self.positions[hi] - self.positions[lo]
        slope = max(0.0, (self.seconds[hi] - self.seconds[lo]) / dp) if dp > 0 else 0.0
        return self.seconds[hi] + slope * max(0.0, positions - self.positions[hi])


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a row emits in one step verifying ``k`` drafts accepted one by one with probability
    ``rate``: the token after its last pending one, and each draft until the first rejection."""
    rate = min(max(rate, 0.0), 0.999)
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def batch_tokens(rows: list[tuple[float, int]], k: int) -> float:
    """Tokens a batch of rows, each (acceptance rate, most drafts it may take), emits in one step verifying
    up to ``k`` drafts per row: each row its own expected run (:func:`expected_tokens`)."""
    return sum(expected_tokens(rate, min(cap, k)) for rate, cap in rows)


def choose_width(cost: StepCost, rows: list[tuple[float, int]], max_positions: int) -> int:
    """The forward width (1 = no speculation) for rows given as (acceptance rate, most drafts it may
    take), within ``max_positions`` (rows x width): the width whose expected tokens per second is best,
    if it beats a plain step's by :data:`MIN_GAIN`. Needs a measured plain step for this batch size."""
    B = len(rows)
    plain = cost.estimate(B) if cost.known(B) else None
    if not B or plain is None:
        return 1
    best_w, best_rate = 1, B / plain * MIN_GAIN
    top = max((cap for _, cap in rows), default=0)
    for w in range(2, min(top + 1, max_positions // B) + 1):
        seconds = cost.estimate(B * w)
        tokens = batch_tokens(rows, w - 1)
        if seconds and tokens / seconds > best_rate:
            best_w, best_rate = w, tokens / seconds
        if not cost.known(B * w):
            break  # one unmeasured size at a time: it is measured by trying it
    return best_w


#: Speculative steps per verdict of :class:`RealizedGain`, and the plain steps a losing batch size then
#: waits before trying again (doubling while it keeps losing, up to the cap).
WINDOW = 8
BACKOFF = 32
MAX_BACKOFF = 1024


class RealizedGain:
    """What speculation delivered, checked against what plain steps deliver, per batch size.

    :func:`choose_width` predicts from each row's recent acceptance rate, as if every row found drafts
    this step; a row that finds no n-gram match pays its width for one token, and rates move. So every
    :data:`WINDOW` speculative steps of a batch size, their tokens per second are compared with a plain
    step's; a batch size that lost stops speculating for a while (:data:`BACKOFF` steps, doubling)."""

    def __init__(self):
        self._window: dict[int, list[float]] = {}  # bucket -> [steps, tokens, seconds]
        self._backoff: dict[int, int] = {}  # bucket -> steps left without speculating
        self._next: dict[int, int] = {}  # bucket -> the backoff after its next loss

    def allows(self, rows: int) -> bool:
        """Whether a batch of ``rows`` may speculate this step (counts a backoff step down if not)."""
        b = _bucket(rows)
        left = self._backoff.get(b, 0)
        if left > 0:
            self._backoff[b] = left - 1
            return False
        return True

    def observe(self, rows: int, tokens: int, seconds: float, cost: StepCost) -> None:
        """A speculative step of ``rows`` rows that delivered ``tokens`` in ``seconds``."""
        b = _bucket(rows)
        w = self._window.setdefault(b, [0, 0.0, 0.0])
        w[0], w[1], w[2] = w[0] + 1, w[1] + tokens, w[2] + seconds
        plain = cost.estimate(rows) if cost.known(rows) else None
        if w[0] < WINDOW or plain is None:
            return
        del self._window[b]
        if w[1] / w[2] < rows / plain:
            self._backoff[b] = self._next.get(b, BACKOFF)
            self._next[b] = min(2 * self._backoff[b], MAX_BACKOFF)
        else:
            self._next[b] = BACKOFF
