"""The batched sampler's top-k / top-p / min-p path (which sorts only the non-negligible tokens of each
row) against a plain full-vocabulary reference: the same kept set, the same seeded tokens, the right
frequencies, and a seeded row's tokens independent of what else is in the batch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from parallm_engine.sampling.sampler import SeqSampler, sample_batch
from parallm_engine.sampling.sampling_params import SamplingParams

V = 4096


def _reference_kept(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Bool mask of the tokens top-k / top-p / min-p keep, by a full sort (the textbook definition)."""
    scaled = row / (p.temperature or 1.0)
    order = np.argsort(-scaled, kind="stable")
    probs = np.exp(scaled[order] - scaled.max())
    probs /= probs.sum()
    keep = np.ones(len(row), bool)
    if 0 < p.top_k < len(row):
        keep[p.top_k:] = False
    keep &= (np.cumsum(probs) - probs) < np.float32(p.top_p)
    keep &= probs >= probs[0] * np.float32(p.min_p)
    mask = np.zeros(len(row), bool)
    mask[order[keep]] = True
    return mask


def _reference_seeded_token(row: np.ndarray, p: SamplingParams, key) -> int:
    """Gumbel-max over the masked full vocabulary with the row's own key (what the sampler promises)."""
    noise = np.array(mx.random.gumbel(shape=(len(row),), key=key))
    scaled = np.where(_reference_kept(row, p), row / (p.temperature or 1.0), -np.inf)
    return int(np.argmax(scaled + noise))


def _logits(kind: str, rng) -> np.ndarray:
    if kind == "peaked":  # like a model's next-token logits: a few likely tokens, a long tail
        x = rng.normal(0, 2.5, V).astype(np.float32)
        x[rng.choice(V, 5, replace=False)] += np.array([14, 12, 11, 9, 8], np.float32)
        return x
    if kind == "flat":  # every token within the negligible line: the whole row is sorted
        return rng.normal(0, 1.0, V).astype(np.float32)
    # "spread": most tokens negligible (a low temperature's view)
    return (rng.normal(0, 1.0, V) * 25).astype(np.float32)


SETTINGS = [
    dict(temperature=0.2, top_p=0.9),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, top_k=40, top_p=0.95),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_k=1000),  # top-k alone, more than the non-negligible tokens
    dict(temperature=1.3, min_p=0.05),
    dict(temperature=0.9, top_p=0.999, min_p=0.001),
]


@pytest.mark.parametrize("kind", ["peaked", "flat", "spread"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_seeded_tokens_equal_the_full_vocabulary_reference(kind, settings):
    rng = np.random.default_rng(hash((kind, tuple(settings.items()))) % 2**32)
    rows = np.stack([_logits(kind, rng) for _ in range(6)])
    params = [SamplingParams(seed=100 + i, **settings) for i in range(len(rows))]
    samplers = [SeqSampler(p, [1, 2]) for p in params]
    # The reference replays each row's key chain from the same seed.
    ref_keys = [mx.random.key(p.seed) for p in params]
    for _step in range(5):
        expected = []
        for i, p in enumerate(params):
            ref_keys[i], sub = mx.random.split(ref_keys[i])
            expected.append(_reference_seeded_token(rows[i], p, sub))
        tokens, _ = sample_batch(mx.array(rows), samplers)
        assert tokens.tolist() == expected


def test_unseeded_frequencies_follow_the_truncated_distribution():
    rng = np.random.default_rng(0)
    row = _logits("peaked", rng)
    p = SamplingParams(temperature=1.0, top_p=0.8, top_k=4)
    kept = _reference_kept(row, p)
    probs = np.where(kept, np.exp(row - row.max()), 0.0)
    probs /= probs.sum()
    n = 4000
    samplers = [SeqSampler(p, [1]) for _ in range(n)]
    tokens = np.array(sample_batch(mx.array(np.tile(row, (n, 1))), samplers)[0])
    counts = np.bincount(tokens, minlength=V) / n
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(kept))
    assert np.abs(counts - probs).max() < 0.03, (counts[kept], probs[kept])


def test_seeded_row_is_batch_invariant_and_mixed_rows_keep_their_rules():
    rng = np.random.default_rng(1)
    rows = np.stack([_logits("peaked", rng) for _ in range(5)])
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    alone = sample_batch(mx.array(rows[:1]), [SeqSampler(seeded, [1])])[0].item()
    chain = SeqSampler(seeded, [1])
    others = [SeqSampler(SamplingParams(temperature=0), [1]),  # greedy
              SeqSampler(SamplingParams(temperature=1.0), [1]),  # temperature only
              SeqSampler(SamplingParams(temperature=1.0, top_k=1), [1]),  # top-1 = greedy
              SeqSampler(SamplingParams(temperature=1.0, min_p=1.0), [1])]  # only the top token survives
    tokens = sample_batch(mx.array(rows), [chain] + others)[0].tolist()
    assert tokens[0] == alone
    assert tokens[1] == int(np.argmax(rows[1]))
    assert tokens[3] == int(np.argmax(rows[3])) and tokens[4] == int(np.argmax(rows[4]))
    assert 0 <= tokens[2] < V
