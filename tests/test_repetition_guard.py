"""The cycle guard (repetition_guard.py): a request that sets no max_tokens stops once its output repeats
one block of tokens over and over (finish_reason "length"); a request that sets max_tokens gets exactly
the tokens it would get without the guard (greedy == mlx-lm is untouched)."""

from __future__ import annotations

import random

from parallm_engine.sampling.repetition_guard import MAX_PERIOD, MIN_SPAN, CycleGuard

from .conftest import chat_ids


def first_cut(ids: list[int]) -> int | None:
    """How many tokens of ``ids`` the guard lets through (None: it never fires)."""
    guard = CycleGuard()
    for n in range(1, len(ids) + 1):
        if guard.cycling(ids[:n]):
            return n
    return None


def test_a_short_block_repeated_is_cut_after_the_minimum_span():
    intro = [5, 6, 7, 8, 9]
    loop = [11, 12, 13, 12]  # "la femme, la femme, ..." : 4 tokens
    ids = intro + loop * 40
    cut = first_cut(ids)
    assert cut is not None and cut == len(intro) + MIN_SPAN  # the block covered MIN_SPAN tokens
    assert first_cut([3] * 200) == MIN_SPAN  # one token over and over


def test_a_long_block_needs_three_copies():
    block = list(range(100, 100 + 40))
    assert first_cut(block * 2 + [1, 2, 3]) is None  # said twice: a repeat, not a cycle
    assert first_cut(block * 3) == 3 * len(block)
    too_long = list(range(1000, 1000 + MAX_PERIOD + 1))
    assert first_cut(too_long * 4) is None  # longer than any period looked for


def test_prose_like_text_never_trips_it():
    rng = random.Random(0)
    words = [rng.randrange(50, 90) for _ in range(5000)]  # a small vocabulary, many repeated words
    assert first_cut(words) is None
    lines = []
    for i in range(60):  # a numbered list: the same line shape with a different number each time
        lines += [300, 1000 + i, 301, 302, 303, 13]
    assert first_cut(lines) is None


def test_engine_cuts_a_looping_request_only_when_it_set_no_max_tokens(tiny_engine):
    """The tiny random model loops under greedy decoding; with max_tokens given it runs to max_tokens,
    unchanged, and without, the guard ends it as soon as the loop is established, with the same tokens."""
    prompt = chat_ids(tiny_engine, "Tell me a story")
    full = tiny_engine.generate([prompt], max_tokens=300, temperature=0)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 300
    cut = first_cut(full.token_ids)
    assert cut is not None and cut < 300, "the tiny model should loop under greedy"
    guarded = tiny_engine.generate([prompt], temperature=0)[0]
    assert guarded.finish_reason == "length"
    assert guarded.token_ids == full.token_ids[:cut]
