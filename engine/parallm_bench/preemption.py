"""The ``preempt`` workload of `parallm bench`: the throughput prompts under a KV budget that holds only part
of what the batch needs by its end, so running rows are preempted (their KV handed to the prefix cache, or
freed) and resume later, as on a machine whose memory the batch outgrows.

The same prompts (distinct, greedy, EOS ignored, all submitted at once), three runs one after the other:

- ``parallm``: the bench's engine (its own budget: nothing is preempted at this size);
- ``parallm_tight``: an engine of the same model and backend whose KV budget is ``fraction`` of the KV the
  batch holds at its end (``requests x (prompt + new) x bytes per token``);
- ``mlx_lm_batch``: mlx-lm's ``BatchGenerator``, which has no budget: its peak memory is what the batch takes.

Reported: tok/s and wall of each, the tight engine's preemptions, its KV held at the peak against its budget
(``peak_kv_held_vs_budget``; the watermark may take it slightly over), whether it gave the same tokens as
the unlimited run (``same_tokens``: a resumed row continues from its own KV, so greedy output must not
change), and the ratios.

JSON::

    {"requests", "prompt_len", "new_tokens", "fraction", "kv_budget_bytes", "same_tokens",
     "parallm": {...}, "parallm_tight": {... "preemptions", "peak_kv_bytes_held"}, "mlx_lm_batch": {...},
     "ratios": {"tight_vs_unlimited": x, "tight_vs_mlx_lm_batch": y}}
"""

from __future__ import annotations

import random
import time

#: (requests, prompt tokens, new tokens, the budget as a fraction of the batch's final KV)
FULL_PREEMPT = (32, 100, 128, 0.5)
QUICK_PREEMPT = (8, 64, 48, 0.5)


def _run(engine, prompts: list[list[int]], new_tokens: int) -> tuple[dict, list[list[int]]]:
    from parallm_bench.bench import release_kv

    engine.clear_prefix_cache()
    engine.reset_peaks()
    before = engine.stats()["preemptions"]
    t0 = time.perf_counter()
    results = engine.generate(prompts, max_tokens=new_tokens, temperature=0, ignore_eos=True)
    wall = time.perf_counter() - t0
    stats = engine.stats()
    release_kv(engine)  # mlx-lm runs next in this process: its peak counts its own arrays only
    tokens = [r.token_ids for r in results]
    return {
        "tok_s": round(sum(len(t) for t in tokens) / wall, 2),
        "wall_s": round(wall, 3),
        "preemptions": stats["preemptions"] - before,
        "peak_kv_bytes": stats["peak_kv_bytes"],
        "peak_kv_bytes_held": stats.get("peak_kv_bytes_held", stats["peak_kv_bytes"]),
    }, tokens


def run_preempt(engine, sizes=FULL_PREEMPT, tick=None) -> dict:
    """The workload on ``engine``'s model (see the module's docstring)."""
    from parallm_engine.core.engine import Engine

    from parallm_bench.bench import run_mlx_lm_batch

    tick = tick or (lambda msg: None)
    n, prompt_len, new_tokens, fraction = sizes
    vocab = engine.model_info.vocab_size
    rng = random.Random(4242)
    prompts = [[rng.randrange(300, vocab) for _ in range(prompt_len)] for _ in range(n)]
    per_token = engine.model_info.kv_bytes_per_token()
    budget = int(fraction * n * (prompt_len + new_tokens) * per_token)
    out: dict = {"requests": n, "prompt_len": prompt_len, "new_tokens": new_tokens, "fraction": fraction,
                 "kv_budget_bytes": budget, "kv_bytes_per_token": per_token}

    tick("preempt: parallm, its own budget")
    out["parallm"], unlimited = _run(engine, prompts, new_tokens)
    tick("preempt: parallm under a budget of part of the batch's KV")
    tight = Engine(engine.model_info.source, backend=engine.backend.name, kv_budget_bytes=budget)
    try:
        tight.generate([prompts[0][:8]], max_tokens=2, temperature=0)  # warm-up
        out["parallm_tight"], constrained = _run(tight, prompts, new_tokens)
        out["parallm_tight"]["peak_kv_held_vs_budget"] = round(out["parallm_tight"]["peak_kv_bytes_held"] / budget, 3)
    finally:
        tight.shutdown()
    out["same_tokens"] = constrained == unlimited
    tick("preempt: mlx-lm BatchGenerator (no budget)")
    out["mlx_lm_batch"] = run_mlx_lm_batch(engine.model, prompts, new_tokens)
    out["ratios"] = {
        "tight_vs_unlimited": round(out["parallm_tight"]["tok_s"] / out["parallm"]["tok_s"], 3),
        "tight_vs_mlx_lm_batch": round(out["parallm_tight"]["tok_s"] / out["mlx_lm_batch"]["tok_s"], 3),
    }
    return out


def format_lines(entry: dict) -> list[str]:
    """``parallm bench``'s lines for the workload (``bench.format_table``)."""
    p, t, m = entry["parallm"], entry["parallm_tight"], entry["mlx_lm_batch"]
    return [
        f"preempt: {entry['requests']} x ({entry['prompt_len']} + {entry['new_tokens']}) tokens under a KV budget of "
        f"{entry['kv_budget_bytes'] / 2**20:.1f} MiB ({entry['fraction']:.0%} of the batch's final KV): "
        f"{t['tok_s']:.1f} tok/s with {t['preemptions']} preemptions, KV held at peak {t['peak_kv_held_vs_budget']:.2f}x "
        f"the budget, same tokens: {entry['same_tokens']}; unlimited {p['tok_s']:.1f} tok/s "
        f"({entry['ratios']['tight_vs_unlimited']:.2f}x); mlx-lm BatchGenerator (no budget) {m['tok_s']:.1f} tok/s, "
        f"peak {m['peak_mem_mb']:.0f} MB ({entry['ratios']['tight_vs_mlx_lm_batch']:.2f}x)",
    ]
