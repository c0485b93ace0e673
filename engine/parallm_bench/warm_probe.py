"""Cold vs warm runs of one workload, ParaLLM and mlx-lm BatchGenerator, and ParaLLM's prefill settings:
`python -m parallm_bench.warm_probe MODEL [--n 32] [--prompt 100] [--new 128]`.

On a GPU, MLX compiles kernels the first time it meets a graph (NVRTC on CUDA) and ``parallm bench`` runs
ParaLLM first, so ParaLLM's first run may pay compilations that mlx-lm's later run reuses. Each system
runs the same prompts twice here (the second run warm); then ParaLLM runs again with larger prefill
chunks and budgets. Prints one line per run: tok/s, TTFT p50, ITL p50, wall and ParaLLM's step breakdown.
"""

from __future__ import annotations

import argparse
import random


def main() -> int:
    import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
    from parallm_bench.bench import _prompts, run_mlx_lm_batch, run_parallm
    from parallm_engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()

    def line(name, r):
        steps = r.get("step_ms") or {}
        print(f"{name:34} {r['tok_s']:8.1f} tok/s  ttft50 {r['ttft_p50_s']:6.3f}s  itl50 {r['itl_p50_s'] * 1e3:6.1f}ms"
              f"  wall {r['wall_s']:6.2f}s  steps {steps}", flush=True)

    settings = [{}, {"prefill_chunk": 2048, "prefill_budget": 8192}, {"prefill_chunk": 4096, "prefill_budget": 16384}]
    eng = None
    for i, cfg in enumerate(settings):
        eng = Engine(args.model, max_batch_size=max(64, args.n), **cfg)
        prompts = _prompts(random.Random(1234), args.n, args.prompt, eng.model_info.vocab_size)
        for rep in ("cold" if i == 0 else "again", "warm"):
            line(f"parallm {cfg or 'defaults'} {rep}", run_parallm(eng, prompts, args.new))
        if i == 0:
            for rep in ("first", "second"):
                line(f"mlx-lm BatchGenerator {rep}", run_mlx_lm_batch(eng.model, prompts, args.new))
        eng.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
