"""Per-request sampling parameters and the batched sampler.

All rows of a decode batch are sampled together: greedy rows by one argmax, temperature-only rows by
Gumbel-max over the (B, V) logits, and rows with top-k / top-p / min-p on the host, each sorting only
its non-negligible tokens (a full-vocabulary sort is ~0.9 s for 32 rows on MLX's CPU backend; this is
milliseconds). Penalties and logit_bias are scatters on just the rows that use them. Seeded rows draw
their Gumbel noise from their own key chain, so a seeded request gives the same tokens whatever else
shares the batch; unseeded rows share one draw.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# The settings themselves and their validation are plain Python (no mlx), for the integrations.
from parallm_engine.sampling.sampling_params import MAX_TOP_LOGPROBS, MODEL_DEFAULT_FIELDS, SamplingParams  # noqa: F401


class SeqSampler:
    """Per-sequence sampling state: the seeded key chain and the token counts for penalties."""

    __slots__ = ("params", "key", "counts", "prompt_ids", "draws", "_history")

    def __init__(self, params: SamplingParams, prompt_ids: list[int], seed_offset: int = 0):
        self.params = params
        self.key = mx.random.key(params.seed + seed_offset) if params.seed is not None else None
        self.counts: dict[int, int] = {}
        self.prompt_ids = set(prompt_ids) if params.repetition_penalty != 1.0 else set()
        self.draws = 0  # keys drawn by next_key
        self._history: dict[int, mx.array] = {}  # the key before each of the last few draws

    def next_key(self):
        self._history[self.draws] = self.key
        self._history.pop(self.draws - 4, None)
        self.draws += 1
        self.key, sub = mx.random.split(self.key)
        return sub

    def rewind_to(self, delivered: int) -> None:
        """Undo draws whose tokens were never delivered (a step that failed after sampling), so a seeded
        sequence resumes on the key it would have used."""
        if self.key is not None and self.draws > delivered and delivered in self._history:
            self.key = self._history[delivered]
            self.draws = delivered

    def observe(self, token: int) -> None:
        if self.params.needs_penalties:
            self.counts[token] = self.counts.get(token, 0) + 1


def _apply_penalties(logits: mx.array, samplers: list[SeqSampler]) -> mx.array:
    rows, cols, rep, pres, freq = [], [], [], [], []
    for i, s in enumerate(samplers):
        p = s.params
        if not p.needs_penalties:
            continue
        toks = set(s.counts) | s.prompt_ids
        for t in toks:
            c = s.counts.get(t, 0)
            rows.append(i)
            cols.append(t)
            rep.append(p.repetition_penalty)
            pres.append(p.presence_penalty if c else 0.0)
            freq.append(p.frequency_penalty * c)
    if not rows:
        return logits
    r = mx.array(rows)
    c = mx.array(cols)
    old = logits[r, c]
    rp = mx.array(rep, dtype=logits.dtype)
    vals = mx.where(old > 0, old / rp, old * rp)
    vals = vals - mx.array(pres, dtype=logits.dtype) - mx.array(freq, dtype=logits.dtype)
    # Tokens a grammar constraint masked to -inf must stay masked (-inf - -inf would be NaN).
    return logits.at[r, c].add(mx.where(mx.isinf(old), 0.0, vals - old))


def _apply_logit_bias(logits: mx.array, samplers: list[SeqSampler]) -> mx.array:
    rows, cols, vals = [], [], []
    vocab = logits.shape[-1]
    for i, s in enumerate(samplers):
        for t, b in (s.params.logit_bias or {}).items():
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
                vals.append(b)
    if not rows:
        return logits
    return logits.at[mx.array(rows), mx.array(cols)].add(mx.array(vals, dtype=logits.dtype))


def sample_batch(logits: mx.array, samplers: list[SeqSampler]):
    """Sample one token per row. Returns (tokens mx.array (B,), logprobs mx.array (B, V) or None).

    ``logits`` is float32 (B, V). Logprobs are of the distribution after penalties and bias, before
    temperature and truncation (what vLLM reports by default).
    """
    if any(s.params.needs_penalties for s in samplers):
        logits = _apply_penalties(logits, samplers)
    if any(s.params.logit_bias for s in samplers):
        logits = _apply_logit_bias(logits, samplers)
    want_logprobs = any(s.params.logprobs for s in samplers)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True) if want_logprobs else None

    greedy = [s.params.greedy for s in samplers]
    argmax = mx.argmax(logits, axis=-1)
    if all(greedy):
        return argmax, logprobs

    B, V = logits.shape
    sampled = [i for i in range(B) if not greedy[i]]
    truncated = [i for i in sampled if _truncates(samplers[i].params, V)]
    plain = [i for i in sampled if not _truncates(samplers[i].params, V)]
    parts = []
    if len(sampled) < B:
        parts.append(argmax[mx.array([i for i in range(B) if greedy[i]])])
    if plain:  # temperature only: Gumbel-max over the whole vocabulary
        rows = [samplers[i] for i in plain]
        scaled = logits[mx.array(plain)] / _temperatures(rows, logits.dtype)[:, None]
        parts.append(mx.argmax(scaled + _row_noise(rows, len(plain), V), axis=-1).astype(argmax.dtype))
    if truncated:
        picked = _sample_truncated(logits, [samplers[i] for i in truncated], truncated)
        parts.append(mx.array(picked, dtype=argmax.dtype))
    # Reassemble in row order.
    order = [i for i in range(B) if greedy[i]] + plain + truncated
    tokens = mx.concatenate(parts)[mx.array(np.argsort(np.array(order)))]
    return tokens, logprobs


#: A token whose temperature-scaled logit is this far below its row's best has probability < e^-30 of
#: the best one's; all of them together < V * e^-30 (5e-9 for a 49k vocabulary), below the float32
#: resolution of the kept mass. Top-p / min-p / top-k sort only the tokens above that line.
_NEGLIGIBLE = 30.0
#: Tokens tried first before sorting a row's whole non-negligible set (usually enough for top-p).
_PARTIAL = 256


def _truncates(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _temperatures(samplers: list[SeqSampler], dtype) -> mx.array:
    return mx.array([s.params.temperature if s.params.temperature > 0 else 1.0 for s in samplers], dtype=dtype)


def _row_noise(samplers: list[SeqSampler], n: int, width: int) -> mx.array:
    """Gumbel noise (n, width); a seeded row's comes from its own key chain, so its token does not
    depend on what else shares the batch."""
    seeded = [i for i, s in enumerate(samplers) if s.key is not None]
    if len(seeded) == n:
        return mx.stack([mx.random.gumbel(shape=(width,), key=s.next_key()) for s in samplers])
    noise = mx.random.gumbel(shape=(n, width))
    if seeded:
        rows = mx.array(seeded)
        own = mx.stack([mx.random.gumbel(shape=(width,), key=samplers[i].next_key()) for i in seeded])
        noise = noise.at[rows].add(own - noise[rows])
    return noise


def _sample_truncated(logits: mx.array, samplers: list[SeqSampler], rows: list[int]) -> list[int]:
    """Top-k / top-p / min-p sampling of ``rows``, on the host: each row sorts only its non-negligible
    tokens (a few hundred, not the whole vocabulary: MLX's CPU sort of a batch's whole logits is orders of
    magnitude slower), falling back to the whole row where top-k alone could keep more. Then Gumbel-max over
    the kept tokens, which draws exactly what Gumbel-max over the masked vocabulary would (a seeded row
    reads its full-width draw at its kept tokens)."""
    V = logits.shape[-1]
    temps = np.array([s.params.temperature if s.params.temperature > 0 else 1.0 for s in samplers], np.float32)
    scaled = np.array(logits[mx.array(rows)].astype(mx.float32)) / temps[:, None]
    seeded = [j for j, s in enumerate(samplers) if s.key is not None]
    own = None  # seeded rows: a full-width draw from each row's own key
    if seeded:
        own = np.array(mx.stack([mx.random.gumbel(shape=(V,), key=samplers[j].next_key()) for j in seeded]))
    kept_rows = []
    for j, s in enumerate(samplers):
        p = s.params
        row = scaled[j]
        best = row.max()
        top_k = p.top_k if 0 < p.top_k < V else V
        cand = np.flatnonzero(row >= best - _NEGLIGIBLE)
        # The negligible tokens are all dropped unless top-k alone (no top-p, no min-p) keeps more.
        if len(cand) < top_k and p.top_p >= 1.0 - 1e-6 and p.min_p <= 1e-12:
            cand = np.arange(V)
        weight = np.exp(row[cand] - best)  # the best token's is 1
        total = weight.sum()  # the softmax normaliser (over every token that is not negligible)
        limit = min(top_k, _PARTIAL)
        if len(cand) > limit:
            # Try the `limit` most likely first: enough when the next one would be dropped anyway.
            part = np.argpartition(-weight, limit - 1)[:limit]
            if (limit == top_k or weight[part].sum() >= np.float32(p.top_p) * total
                    or weight[part].min() < np.float32(p.min_p)):
                cand, weight = cand[part], weight[part]
        order = np.argsort(-weight, kind="stable")
        cand, probs = cand[order], weight[order] / total
        cum_before = np.cumsum(probs) - probs
        # Each rule keeps a prefix of the sorted tokens (the top one always survives).
        n_keep = max(1, min(top_k, int(np.count_nonzero(cum_before < np.float32(p.top_p))),
                            int(np.count_nonzero(probs >= probs[0] * np.float32(p.min_p)))))
        kept_rows.append((cand[:n_keep], row[cand[:n_keep]]))
    width = max(len(c) for c, _ in kept_rows)
    shared = np.array(mx.random.gumbel(shape=(len(samplers), width))) if len(seeded) < len(samplers) else None
    seeded_at = {j: k for k, j in enumerate(seeded)}
    tokens = []
    for j, (cand, vals) in enumerate(kept_rows):
        noise = own[seeded_at[j]][cand] if j in seeded_at else shared[j, : len(cand)]
        tokens.append(int(cand[np.argmax(vals + noise)]))
    return tokens


def top_logprobs_for(row_logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    idx = np.argpartition(-row_logprobs, k - 1)[:k]
    idx = idx[np.argsort(-row_logprobs[idx])]
    return [(int(i), float(row_logprobs[i])) for i in idx]
