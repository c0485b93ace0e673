"""How much a speculative step should verify, from what steps are measured to cost on this machine.

Verifying drafts costs positions: one forward over every row's 1 + k positions (a ragged step: a row
computes only its own positions; ``BatchForward.forward_ragged``). Whether that pays depends on the
hardware, not on a constant: where a decode step is bound by reading the weights (Apple silicon, GPUs, a
CPU at batch 1) extra positions are nearly free; where it is bound by compute (a CPU at batch 32) each
costs about as much as a row. So the scheduler times its steps and :class:`StepCost` keeps seconds per
step by its rows and the positions it computed (half-octave buckets of each). :func:`choose_width`
then picks, before a step, whether it is worth stopping the pipeline to look for drafts and how many a
row may verify: the width whose expected tokens per second beats a plain step's, each row's recent
acceptance giving its expected tokens (a row whose first draft is accepted with probability f and each
next one, after an accepted one, with c emits 1 + f + f c + ... + f c^(k-1) tokens for k drafts).
Every row emits its own accepted run (rows keep different numbers of positions:
``kv_pages.PagedLaneKV.rollback_rows``), so a batch's expectation is the sum of its rows'
(:func:`batch_tokens`).

Costs are learnt by running: a batch size's first speculative steps are estimated optimistically (as
a plain step, then flat from the sizes measured), so a large step gets tried; once the measured sizes
span a few positions the least-squares line through them says what more positions cost, and a batch
that is compute-bound stops speculating.
"""

from __future__ import annotations

import math

#: Observations a bucket keeps (its cost is their lower median; the least of them while it has fewer than 3).
_KEEP = 5
#: A speculative step must promise this much more throughput than a plain step (noise, and a verify
#: step cannot overlap the host's work with the device's as a plain pipelined step does: measured, but
#: the measurement is noisy).
MIN_GAIN = 1.1


def _bucket(n: int) -> int:
    return round(2 * math.log2(n))  # half-octaves: 1, 2, 3, 4, 5-6, 7-9, 10-13, 14-19, ...


class _Samples:
    """A bucket's last few step times and sizes. Its cost is their (lower) median, or their least while
    there are fewer than three: a step is slowed, never sped up, by what else happens (another thread's
    work, a page pool growing), and one such step must not set what a size costs."""

    __slots__ = ("seconds", "positions")

    def __init__(self):
        self.seconds: list[float] = []
        self.positions: list[float] = []

    def add(self, seconds: float, positions: int) -> None:
        self.seconds = (self.seconds + [seconds])[-_KEEP:]
        self.positions = (self.positions + [float(positions)])[-_KEEP:]

    @property
    def cost(self) -> float:
        s = sorted(self.seconds)
        return s[0] if len(s) < 3 else s[(len(s) - 1) // 2]  # the lower median

    @property
    def size(self) -> float:
        return sum(self.positions) / len(self.positions)


class StepCost:
    """Seconds per decode step (forward, sampling, delivery): plain steps by their rows, speculative ones
    by their rows and the positions their forward computed (half-octave buckets). Speculative sizes are
    kept per batch size: the attention reads each row's keys once however many positions it verifies, so
    24 positions of 8 rows cost less than a plain step of 24 rows."""

    def __init__(self):
        self.plain: dict[int, _Samples] = {}  # rows bucket -> plain steps
        self.spec: dict[tuple[int, int], _Samples] = {}  # (rows, positions) buckets -> speculative steps

    def observe_plain(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds > 0:
            self.plain.setdefault(_bucket(rows), _Samples()).add(seconds, rows)

    def observe(self, rows: int, positions: int, seconds: float) -> None:
        """A speculative step of ``rows`` rows whose forward computed ``positions`` positions."""
        if rows > 0 and positions > 0 and seconds > 0:
            self.spec.setdefault((_bucket(rows), _bucket(positions)), _Samples()).add(seconds, positions)

    def plain_seconds(self, rows: int) -> float | None:
        """Seconds of a plain step of ``rows`` rows, None until one is measured."""
        samples = self.plain.get(_bucket(rows))
        return None if samples is None else samples.cost

    def estimate(self, rows: int, positions: int) -> float | None:
        """Seconds of a speculative step of ``rows`` rows and ``positions`` positions: the least-squares
        line through the sizes measured for this batch size (never falling with positions). Past the
        largest size measured the line is followed only once the measured sizes span at least
        :data:`SPAN` positions; before that the estimate stays flat there (optimistic: a larger size gets
        tried, which is how the slope is learnt; a span of a position or two is mostly noise). Flat from
        the plain step when nothing speculative is measured. None until a plain step of this size is, and
        past :data:`GROWTH` times the largest size measured."""
        plain = self.plain_seconds(rows)
        if plain is None:
            return None
        r = _bucket(rows)
        points = [(b.size, b.cost) for (rb, _), b in self.spec.items() if rb == r]
        if positions > GROWTH * max((p for p, _ in points), default=rows):
            return None  # too far past what is measured to guess (a CPU's kernels change at some sizes)
        if not points:
            return plain
        n = len(points)
        mp = sum(p for p, _ in points) / n
        mt = sum(t for _, t in points) / n
        var = sum((p - mp) ** 2 for p, _ in points)
        slope = max(0.0, sum((p - mp) * (t - mt) for p, t in points) / var) if var > 0 else 0.0
        lo, hi = min(p for p, _ in points), max(p for p, _ in points)
        if hi - lo < SPAN:
            positions = min(positions, hi)
        return mt + slope * (positions - mp)


#: Sizes are tried at most this many times the largest measured for the batch size (or its plain step):
#: a batch size learns its costs upwards in a few steps, and one step past a cliff (a 2-core CPU's native
#: linear hands rows past 64 to BLAS at several times the cost) is all it pays to find it.
GROWTH = 2
#: Positions the measured speculative sizes of a batch size must span before the cost line is
#: extrapolated past them (:meth:`StepCost.estimate`).
SPAN = 8


def _clamp(rate: float) -> float:
    return min(max(rate, 0.0), 0.999)


def run_odds(first: float, k: int, cont: float | None = None) -> list[float]:
    """The probabilities that a row's first 1 .. ``k`` drafts are all accepted: ``first`` for the first
    and ``cont`` for each next given the one before (None: ``first`` again, independent drafts).
    Acceptance is bursty (a row that copies accepts runs, one that does not fails at once), so a row's
    ``cont`` is measured apart from its ``first`` (``speculative.RowState``)."""
    first = _clamp(first)
    cont = first if cont is None else _clamp(cont)
    odds, p = [], first
    for _ in range(k):
        odds.append(p)
        p *= cont
    return odds


def expected_tokens(rate: float, k: int, cont: float | None = None) -> float:
    """Tokens a row emits in one step verifying ``k`` drafts (:func:`run_odds`): the token after its last
    pending one, and each draft until the first rejection."""
    return 1.0 + sum(run_odds(rate, k, cont))


def _row(row: tuple) -> tuple[float, int, float | None]:
    """A row as (first-draft rate, drafts, continuation rate or None): rows are (rate, drafts[, cont])."""
    return row[0], row[1], (row[2] if len(row) > 2 else None)


def batch_tokens(rows: list[tuple], k: int) -> float:
    """Tokens a batch of rows, each (acceptance rate, most drafts it may take[, continuation rate]),
    emits in one step verifying up to ``k`` drafts per row: each row its own expected run."""
    total = 0.0
    for row in rows:
        rate, cap, cont = _row(row)
        total += expected_tokens(rate, min(cap, k), cont)
    return total


def batch_positions(rows: list[tuple], k: int) -> int:
    """Positions a ragged step computes verifying up to ``k`` drafts per row (a row its own 1 + drafts)."""
    return sum(1 + min(row[1], k) for row in rows)


def choose_width(cost: StepCost, rows: list[tuple], max_positions: int) -> int:
    """The forward width (1 = no speculation) for rows given as (acceptance rate, most drafts it may
    take), within ``max_positions`` (rows x width): the width whose expected tokens per second is best,
    if it beats a plain step's by :data:`MIN_GAIN`. Needs a measured plain step for this batch size."""
    B = len(rows)
    plain = cost.plain_seconds(B) if B else None
    if plain is None:
        return 1
    best_w, best_rate = 1, B / plain * MIN_GAIN
    top = max((row[1] for row in rows), default=0)
    for w in range(2, min(top + 1, max_positions // B) + 1):
        positions = batch_positions(rows, w - 1)
        seconds = cost.estimate(B, positions)
        tokens = batch_tokens(rows, w - 1)
        if seconds and tokens / seconds > best_rate:
            best_w, best_rate = w, tokens / seconds
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
        plain = cost.plain_seconds(rows)
        if w[0] < WINDOW or plain is None:
            return
        del self._window[b]
        if w[1] / w[2] < rows / plain:
            self._backoff[b] = self._next.get(b, BACKOFF)
            self._next[b] = min(2 * self._backoff[b], MAX_BACKOFF)
        else:
            self._next[b] = BACKOFF
