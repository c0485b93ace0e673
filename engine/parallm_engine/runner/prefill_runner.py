"""The batched prefill forward ("attention" layout): several short contexts, each continuing its own
cached prefix, in one forward pass per decode lane.

The scheduler decides which sequences prefill together (``prefill_planner``) and the model runner
runs them (``model_runner``); this module builds their left-padded batch (``kv_cache.PrefillBatchKV``:
each row's cached prefix, padded to the longest, then its new tokens), runs the model's own forward once
per lane share, and cuts each row's KV back out (``PrefillBatchKV.row``). A group whose rows all
continue one cached prefix (the agent fan-out) reads it once (cascade attention) where the engine's
attention hook runs, instead of one broadcast copy per row. Logits are never evaluated: only the KV is
kept (the last context token runs in the decode step). Image rows read their vision features
(``vision.prefill_forward``).
"""

from __future__ import annotations

import mlx.core as mx

from parallm_engine.kv import kv_quant as kvq
from parallm_engine.kv.kv_cache import PrefillBatchKV, prefill_layout
from parallm_engine.embed.embedding import pooled_arrays, prefill_forward


def run_prefill_group(model, batch, group: list, n_layers: int, stats, *, share_prefix: bool,
                      mask_5d: bool, fmt=None) -> list[tuple]:
    """Prefill ``group`` (sequences with ``prefill_ids``, ``pos``, ``cached_tokens``, ``prefix_kv``):
    the group is split into token-balanced shares that run at the same time on the decode lanes'
    streams (one share on Metal/CUDA). Returns ``(sequence, its per-layer KV)`` in group order; each
    sequence's ``prefix_kv`` is released."""
    shares = split_balanced(group, [len(s.prefill_ids) - s.pos for s in group], len(batch.lanes))
    arrays, rows = [], []
    for share, ctx in zip(shares, batch.lane_contexts()):
        with ctx:
            arr, cut = _forward_share(model, share, n_layers, stats, share_prefix, mask_5d, fmt)
        arrays += arr
        rows.append(cut)
    mx.eval(arrays)
    out = []
    for cut in rows:
        out += cut()
    return out


def _forward_share(model, group: list, n_layers: int, stats, share_prefix: bool, mask_5d: bool, fmt):
    """Lazy: the share's new KV arrays, and a function that cuts out each sequence's KV."""
    prefix_lens = [s.cached_tokens for s in group]
    new_lens = [len(s.prefill_ids) - s.pos for s in group]
    offset, mask, P, L = prefill_layout(prefix_lens, new_lens)
    if mask_5d:
        mask = mask[:, :, None]
    tokens = mx.array([[0] * (L - n) + s.prefill_ids[s.pos :] for s, n in zip(group, new_lens)])
    caches = []
    shared = P and all(p == P for p in prefix_lens) and all(s.prefix_kv is not None for s in group)
    for layer in range(n_layers):
        if shared and all(s.prefix_kv[layer][0] is group[0].prefix_kv[layer][0] for s in group[1:]):
            # Every row continues the same cached prefix (the agent fan-out). With the engine's
            # attention hook it is read once for all rows (cascade attention); otherwise it is
            # broadcast, and the attention's concatenation makes the only copy.
            k, v = group[0].prefix_kv[layer]
            if share_prefix:
                caches.append(PrefillBatchKV(k, v, offset, mask, shared=True, fmt=fmt))
            else:
                caches.append(PrefillBatchKV(kvq.broadcast_rows(k, len(group)), kvq.broadcast_rows(v, len(group)),
                                             offset, mask, fmt=fmt))
        elif P:
            # Rows without a prefix are padded with zeros shaped like another row's prefix (the
            # layer's own KV shape: MLA latents and per-layer head counts included).
            ref_k, ref_v = next(s.prefix_kv[layer] for s in group if s.prefix_kv is not None)
            pk, pv = [], []
            for s, p in zip(group, prefix_lens):
                if p:
                    k, v = s.prefix_kv[layer]
                    pad = [(0, 0), (0, 0), (P - p, 0), (0, 0)]
                    pk.append(kvq.pad(k, pad))
                    pv.append(kvq.pad(v, pad))
                else:
                    pk.append(kvq.zeros((1, ref_k.shape[1], P, ref_k.shape[3]), ref_k))
                    pv.append(kvq.zeros((1, ref_v.shape[1], P, ref_v.shape[3]), ref_v))
            caches.append(PrefillBatchKV(kvq.concatenate(pk), kvq.concatenate(pv), offset, mask, fmt=fmt))
        else:
            caches.append(PrefillBatchKV(None, None, offset, mask, fmt=fmt))
    prefill_forward(model, tokens, caches, [(s, s.pos, n) for s, n in zip(group, new_lens)])
    stats.prefill_tokens += sum(new_lens)
    stats.prefill_forwards += 1

    def cut() -> list[tuple]:
        out = []
        for i, (s, p, n) in enumerate(zip(group, prefix_lens, new_lens)):
            out.append((s, [c.row(i, p, n, P, L) for c in caches]))
            s.prefix_kv = None
        return out

    return [a for c in caches for x in (c.keys, c.values) for a in kvq.arrays(x)] + pooled_arrays(group), cut


def split_balanced(items: list, weights: list[int], n: int) -> list[list]:
    """At most ``n`` non-empty shares of ``items`` with near-equal total weight (largest first into
    the lightest share), each keeping the items' original order."""
    if n <= 1 or len(items) <= 1:
        return [list(items)]
    loads = [0] * n
    owner = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: -weights[i]):
        g = loads.index(min(loads))
        loads[g] += weights[i]
        owner[i] = g
    shares = [[x for x, o in zip(items, owner) if o == g] for g in range(n)]
    return [share for share in shares if share]
