"""`parallm bench --workloads rerank`: a decoder reranker on the shared engine vs one pair at a time.

The model is a random-weight qwen3 at Qwen3-Reranker-0.6B's width (hidden 1024, 16/8 heads, MLP 3072) with
``layers`` of its 28 layers (``--quick``: a 2-layer, 64-wide model), the default model's tokenizer, and a
name that marks it a reranker; one query and ``docs`` candidate passages of 20-120 words, in Qwen3-Reranker's
prompt (``embed/rerank.py``). Measured on one engine, same run:

- ``sequential``: mlx-lm's qwen3 class on the engine's weights, one pair at a time: the last position's
  logits, softmax over the "yes" / "no" tokens (what a loop over the model card's code does).
- ``parallm``: ``Engine.rerank(query, docs)``: every pair a request of the batch; the pairs' shared prefix
  (system turn, instruction, query) is computed once through the radix cache (``prefill_tokens`` against the
  pairs' tokens says how much was not recomputed).

Numbers from a shared machine vary: compare ratios within one run.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

FULL_RERANK = {"hidden": 1024, "layers": 4, "heads": 16, "kv_heads": 8, "mlp": 3072, "docs": 64}
QUICK_RERANK = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "mlp": 128, "docs": 64}
QUERY = "which passage says where the river meets the mountain city"


def run_sequential(engine, ids_list: list[list[int]], yes: int, no: int) -> dict:
    """mlx-lm's own model on the engine's weights, one pair at a time (on the engine thread, idle meanwhile)."""
    import mlx.core as mx

    def loop():
        t0 = time.perf_counter()
        for ids in ids_list:
            logits = engine.model(mx.array([ids]))[0, -1].astype(mx.float32)
            mx.eval(mx.softmax(mx.stack([logits[no], logits[yes]]))[1])
        return time.perf_counter() - t0

    wall = engine.run_on_engine_thread(loop)
    return {"pairs": len(ids_list), "wall_s": round(wall, 3), "pairs_per_s": round(len(ids_list) / wall, 2)}


def run_rerank(sizes: dict, tick=None, backend: str | None = None) -> dict:
    """The rerank workload on its own random model and engine."""
    from parallm_bench.embed import _texts, build_embedder
    from parallm_engine.core.engine import Engine
    from parallm_engine.embed.rerank import decoder_prompt
    from parallm_engine.kv.radix_cache import common_prefix_len

    tick = tick or (lambda msg: None)
    tmp = Path(tempfile.mkdtemp(prefix="parallm-bench-rerank-"))
    engine = None
    try:
        path = build_embedder(tmp / "qwen3-reranker-bench", sizes, sentence_transformers=False)
        engine = Engine(str(path), backend=backend)
        docs = _texts(sizes["docs"], seed=5)
        engine.rerank("a warm-up query", docs[:2])  # compiles; its prefix is not the measured query's
        prompt = decoder_prompt(engine.tokenizer, engine.model_info.name)
        limit = engine.model_info.context_window
        ids = [prompt.pair_ids(engine.tokenizer, QUERY, d, None, limit, True)[0] for d in docs]
        shared = min(common_prefix_len(ids[0], other) for other in ids[1:]) if len(ids) > 1 else 0
        out = {"model": {k: sizes[k] for k in ("hidden", "layers", "heads", "kv_heads", "mlp")},
               "docs": len(docs), "mean_pair_tokens": round(sum(map(len, ids)) / len(ids), 1),
               "shared_prefix_tokens": shared, "sequential": run_sequential(engine, ids, prompt.yes, prompt.no)}
        tick("rerank sequential")
        before = engine.stats()["prefill_tokens"]
        t0 = time.perf_counter()
        ranked = engine.rerank(QUERY, docs)
        wall = time.perf_counter() - t0
        computed = engine.stats()["prefill_tokens"] - before
        tick("rerank parallm")
        pair_tokens = sum(map(len, ids))
        out["parallm"] = {"pairs": len(ranked), "wall_s": round(wall, 3), "pairs_per_s": round(len(ranked) / wall, 2),
                          "prefill_tokens": computed, "pair_tokens": pair_tokens,
                          "prefill_saved": round(1 - computed / pair_tokens, 3)}
        out["ratios"] = {"parallm_vs_sequential": round(out["parallm"]["pairs_per_s"]
                                                        / out["sequential"]["pairs_per_s"], 2)}
        return out
    finally:
        if engine is not None:
            engine.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def format_lines(entry: dict) -> list[str]:
    m, p = entry["model"], entry["parallm"]
    return [
        f"rerank: random qwen3 reranker (hidden {m['hidden']}, {m['layers']} layers), one query x {entry['docs']} "
        f"passages, pairs of ~{entry['mean_pair_tokens']} tokens sharing a {entry['shared_prefix_tokens']}-token "
        "prefix; pairs/s",
        f"  one pair at a time (mlx-lm): {entry['sequential']['pairs_per_s']}",
        f"  parallm, all pairs in the batch: {p['pairs_per_s']} ({entry['ratios']['parallm_vs_sequential']}x); "
        f"prefill {p['prefill_tokens']} of the pairs' {p['pair_tokens']} tokens "
        f"({p['prefill_saved']:.0%} not recomputed)",
    ]
