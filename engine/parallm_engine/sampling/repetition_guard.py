"""Stop a sequence that is cycling: its last tokens one block repeated over and over.

A small model sampled at its recommended low temperature sometimes falls into a loop ("la femme, la femme,
la femme, ...") that nothing but ``max_tokens`` or the end of the context ends: minutes of tokens nobody
reads. The engine arms this guard only for requests that set no ``max_tokens`` (so a caller who asks for a
length gets exactly what mlx-lm would give, and greedy tests compare unchanged), and ends such a sequence
with ``finish_reason="length"``: cut short, not a natural end.

What counts as a cycle: a block of ``p`` tokens (1 <= p <= :data:`MAX_PERIOD`) repeated back to back over
at least :data:`MIN_SPAN` tokens and at least :data:`MIN_REPEATS` times. Prose, lists and code repeat words
and lines, but not one exact block many times in a row.
"""

from __future__ import annotations

import numpy as np

MAX_PERIOD = 64  # the longest repeated block looked for, in tokens
MIN_SPAN = 64  # tokens the repetition must cover before the sequence is cut
MIN_REPEATS = 3  # and at least this many copies of the block (a long block must recur three times)


class CycleGuard:
    """Per-sequence state, O(:data:`MAX_PERIOD`) work per token: ``runs[p - 1]`` is how many of the latest
    tokens each equal the token ``p`` places before them (the tail is ``p``-periodic over ``runs + p``)."""

    __slots__ = ("runs",)

    def __init__(self) -> None:
        self.runs = np.zeros(MAX_PERIOD, dtype=np.int64)

    def cycling(self, ids: list[int]) -> bool:
        """Take in the newest token of ``ids`` (call once per token); True once the tail is a cycle."""
        n = len(ids)
        if n < 2:
            return False
        earlier = np.asarray(ids[max(0, n - 1 - MAX_PERIOD):n - 1][::-1])  # p = 1, 2, ... tokens back
        k = len(earlier)
        self.runs[:k] = np.where(earlier == ids[-1], self.runs[:k] + 1, 0)
        periods = np.arange(1, k + 1)
        need = np.maximum(MIN_SPAN, MIN_REPEATS * periods) - periods
        return bool(np.any(self.runs[:k] >= need))
