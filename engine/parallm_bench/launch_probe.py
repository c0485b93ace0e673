"""Where a GPU decode step's host time goes, ParaLLM and mlx-lm side by side:
`python -m parallm_bench.launch_probe MODEL [--n 32] [--prompt 100] [--steps 96]`.

On a GPU, ``mx.async_eval`` encodes the step's kernels on the calling thread (MLX's CUDA backend adds them
to CUDA graphs and launches a graph every ``MLX_MAX_OPS_PER_BUFFER`` ops), so a short step is the host's
Python (building the graph) plus that launch. ParaLLM's engine reports both (``step_ms``: decode_host,
launch); for mlx-lm this replays BatchGenerator's decode step (``GenerationBatch._step``: forward, logprobs,
argmax, ``async_eval``, then waiting for the previous step's tokens) on its own ``BatchKVCache`` and times
the three parts. Run it once per MLX setting (``MLX_USE_CUDA_GRAPHS=0``, ``MLX_MAX_OPS_PER_BUFFER=N`` are
read once per process) to see which costs move.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def mlx_lm_steps(model, prompts: list[list[int]], steps: int, tokens: bool = False) -> dict:
    """Mean ms per decode step of mlx-lm's batched decode, split into graph build, launch and wait
    (``tokens``: also each prompt's greedy tokens, the prefill's first, under "tokens")."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    cache = [BatchKVCache([0] * len(prompts)) for _ in model.layers]
    logits = model(mx.array(prompts), cache=cache)[:, -1, :]
    y = mx.argmax(logits, axis=-1)
    lp = list(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    mx.eval(y, lp)
    build, launch, wait, total = [], [], [], []
    out = [[t] for t in y.tolist()]
    for i in range(steps):
        t0 = time.perf_counter()
        logits = model(y[:, None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nxt = mx.argmax(logprobs, axis=-1)
        nxt_lp = list(logprobs)
        t1 = time.perf_counter()
        mx.async_eval(nxt, nxt_lp)
        t2 = time.perf_counter()
        mx.eval(y, lp)
        prev = y.tolist()
        t3 = time.perf_counter()
        if tokens and i > 0:
            for row, t in zip(out, prev):
                row.append(t)
        y, lp = nxt, nxt_lp
        build.append(t1 - t0)
        launch.append(t2 - t1)
        wait.append(t3 - t2)
        total.append(t3 - t0)
    skip = min(8, steps // 4)  # the first steps compile
    ms = lambda xs: round(1e3 * statistics.mean(xs[skip:]), 3)  # noqa: E731
    result = {"build": ms(build), "launch": ms(launch), "wait": ms(wait), "step": ms(total)}
    if tokens:
        for row, t in zip(out, y.tolist()):
            row.append(t)
        result["tokens"] = out
    return result


def main() -> int:
    import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
    import mlx.core as mx
    from parallm_bench.bench import _prompts, run_parallm
    from parallm_engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--only", choices=["parallm", "mlx-lm"], default=None)
    args = ap.parse_args()

    eng = Engine(args.model, max_batch_size=max(64, args.n))
    prompts = _prompts(random.Random(1234), args.n, args.prompt, eng.model_info.vocab_size)
    print("device", mx.default_device(), "rows", args.n, "prompt", args.prompt, flush=True)
    if args.only != "mlx-lm":
        for rep in ("warm 1", "warm 2", "timed"):
            r = run_parallm(eng, prompts, args.steps)
            compiled = eng.stats()["memory"].get("decode_compiled_steps", 0)  # PARALLM_COMPILE_DECODE=1
            print(f"parallm {rep:7} itl50 {r['itl_p50_s'] * 1e3:7.2f} ms  tok/s {r['tok_s']:8.1f}"
                  f"  step_ms {r['step_ms']}  compiled steps {compiled}", flush=True)
    model = eng.model
    eng.shutdown()
    if args.only != "parallm":
        for rep in ("warm", "timed"):
            print(f"mlx-lm  {rep:7} step_ms {mlx_lm_steps(model, prompts, args.steps)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
