"""The scheduler's trade-offs in one line, ParaLLM alone: ``python -m parallm_bench.scheduling [MODEL] [--reps N]``.

A change to how prefill and decode share the steps (``core/prefill_planner.py``, the step-time target) moves
three workloads in different directions, so this runs them back to back on one engine:

- **burst**: ``--burst`` prompts of 100 tokens at once, 128 new tokens each (tok/s, TTFT p50 / p95, ITL p50 /
  p95): how fast a queue of short prompts is absorbed;
- **arrival**: 8 streams decoding when one ``--arrival-tokens`` prompt arrives, and 0.3 s later 4 prompts of
  100 tokens (``paths.run_arrival``: its TTFT, the streams' ITL before and while it is prefilled, the short
  prompts' TTFT): what pacing a long prompt protects, and what it makes the prompts behind it wait;
- **agents**: a small agents trace (8 agents, 2-4 turns, an 800-token system prompt, tool results of 100-400
  tokens, 1 arrival/s; ``agents.run_parallm_agents``): goodput, TTFT p50 / p99, ITL p50 / p99.

For an A/B, run it from two checkouts one after the other, alternating (``PYTHONPATH=<old>/engine``); the
backend is the environment's (``PARALLM_BACKEND=cpu-mlx`` for the pure-MLX path).
"""

from __future__ import annotations

import argparse
import random

#: The agents trace of this probe: a few minutes on a 2-core CPU, several turns in flight at once.
SCHEDULING_AGENTS = dict(agents=8, min_turns=2, max_turns=4, system_tokens=800, tool_min=100, tool_max=400,
                         reply_tokens=24, rate=1.0)


def run(engine, burst: int = 32, burst_tokens: int = 128, arrival_tokens: int = 2000, streams: int = 8,
        agents: dict | None = None) -> dict:
    """The three workloads on ``engine``, each from a cold prefix cache."""
    from parallm_bench import agents as ba
    from parallm_bench import paths as bp
    from parallm_bench.bench import _prompts, run_parallm

    out: dict = {}
    prompts = _prompts(random.Random(1234), burst, 100, engine.model_info.vocab_size)
    out["burst"] = run_parallm(engine, prompts, burst_tokens)
    engine.clear_prefix_cache()
    out["arrival"] = bp.run_arrival(engine, streams, arrival_tokens, 160, shorts=4)
    sizes = ba.AgentSizes(**(agents or SCHEDULING_AGENTS))
    trace = ba.build_trace(lambda s: engine.encode(s, add_special_tokens=False), sizes)
    out["agents"] = ba.run_parallm_agents(engine, trace)
    engine.clear_prefix_cache()
    return out


def format_line(r: dict) -> str:
    b, a, g = r["burst"], r["arrival"], r["agents"]
    return (f"burst {b['tok_s']:.1f} tok/s, TTFT p50/p95 {b['ttft_p50_s']:.2f}/{b['ttft_p95_s']:.2f} s, ITL p50/p95 "
            f"{1e3 * b['itl_p50_s']:.0f}/{1e3 * b['itl_p95_s']:.0f} ms | arrival TTFT {a['long_ttft_s'] or 0:.2f} s, "
            f"ITL before {1e3 * a['itl_before_p50_s']:.0f} ms, during p50/p99/max {1e3 * a['itl_during_p50_s']:.0f}/"
            f"{1e3 * a['itl_during_p99_s']:.0f}/{1e3 * a['itl_during_max_s']:.0f} ms, {a['shorts']} short prompts after it TTFT "
            f"p50/max {a['short_ttft_p50_s']:.2f}/{a['short_ttft_max_s']:.2f} s | agents "
            f"{g['goodput_runs_per_min']:.2f} runs/min, TTFT p50/p99 {g['ttft_p50_s']:.2f}/{g['ttft_p99_s']:.2f} s, "
            f"ITL p50/p99 {1e3 * g['itl_p50_s']:.0f}/{1e3 * g['itl_p99_s']:.0f} ms")


def main(argv=None) -> int:
    import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
    from parallm_engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="default: the embedded default model")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--arrival-tokens", type=int, default=2000)
    args = ap.parse_args(argv)
    engine = Engine(args.model, max_batch_size=max(64, args.burst))
    try:
        engine.generate("Hello there", max_tokens=8)  # warm
        print(f"{engine.backend.name}, {engine.model_info.source}", flush=True)
        for _ in range(args.reps):
            print(format_line(run(engine, args.burst, arrival_tokens=args.arrival_tokens)), flush=True)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
