"""`parallm bench`'s command-line driver: options -> model (or ``--shape``) -> workloads -> table, JSON, plots."""

from __future__ import annotations

import json
import os

from parallm_bench.bench import ALL_WORKLOADS, DEFAULT_WORKLOADS, FULL, QUICK, SHAPE_WORKLOADS, format_table, run_bench
from parallm_engine.errors import ParaLLMError


def main(args) -> int:
    from tqdm import tqdm

    from parallm_engine.core.registry import get_engine

    if getattr(args, "plot", None) and (args.workloads or "").strip() != "curve":  # the curve has an SVG without it
        from parallm_bench.plot import check_available

        check_available()  # before the run, not after it
    if getattr(args, "distributed", None):  # its own servers (1 rank, N ranks under mlx.launch), alone
        from parallm_bench.distributed import main as distributed_main

        return distributed_main(args)
    shape = None
    model = args.model
    if getattr(args, "shape", None):
        from parallm_bench.shapes import prepare

        if args.model:
            raise ParaLLMError("--shape builds its own model: give --shape or --model, not both")
        print(f"building the {args.shape} shape (random weights; reused from the cache once built) ...")
        model, shape = prepare(args.shape, getattr(args, "shape_layers", None), getattr(args, "shape_budget_gb", None))
        print(shape.describe())
    workloads_arg = args.workloads or (SHAPE_WORKLOADS if shape else DEFAULT_WORKLOADS)
    workloads = [w.strip() for w in workloads_arg.split(",") if w.strip()]
    if "soak" in workloads:  # its own server and KV budget, for minutes to hours: never beside other workloads
        if workloads != ["soak"] or shape is not None:
            raise ParaLLMError("the soak runs alone: --workloads soak (with --model, not --shape)")
        from parallm_bench.soak import main as soak_main

        return soak_main(args)
    unknown = [w for w in workloads if w not in ALL_WORKLOADS]
    if unknown:
        raise ParaLLMError(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(ALL_WORKLOADS)}")
    # The peers keep nothing between runs: neither do the benchmark's engines (every one it starts, in this
    # process or a server's), unless --kv-disk asks for the disk tier.
    os.environ["PARALLM_KV_DISK"] = str(getattr(args, "kv_disk", None) or 0)
    cfg = {}
    if getattr(args, "max_batch_size", None):
        cfg["max_batch_size"] = args.max_batch_size
    if getattr(args, "weights_dtype", None):
        cfg["weights_dtype"] = args.weights_dtype  # bfloat16: weights stored bf16 on the CPU (weights_dtype.py)
    if getattr(args, "path", "native") == "mlx":
        cfg["backend"] = "cpu-mlx"  # every workload on MLX's own ops (the path Metal and CUDA take)
        if "paths" not in workloads:
            workloads.append("paths")
    engine = get_engine(str(model) if model is not None else None, **cfg)
    engine.generate([[300, 301, 302]], max_tokens=2, temperature=0)  # warm-up
    reps = (QUICK if args.quick else FULL).single_reps
    steps = sum({"throughput": 3, "fanout": 4, "single": 2 * reps, "peer": 3, "roofline": 1, "llamacpp": 6,
                 "agents": 3, "longctx": 1, "paths": 1, "arrival": 1, "memory": 2, "preempt": 3, "constrained": 1, "vision": 3,
                 "embed": 6, "rerank": 2, "lora": 8, "restart": 8, "sessions": 4,
                 "programs": 5, "curve": 9 if args.quick else 21,
                 "observe": 12}.get(w, 0)
                for w in workloads)
    agent_sizes, longctx_sizes = _sizes_from_args(args)
    ray_replicas = getattr(args, "ray_replicas", None)
    on_ray = bool(ray_replicas) and "agents" in workloads
    if on_ray:  # the agents trace through `parallm serve --ray` instead of in this process
        from parallm_engine.serve.ray_launch import require_ray

        require_ray()
        workloads.remove("agents")
        steps += 1
    trace = engine.trace(args.trace) if getattr(args, "trace", None) else None
    with tqdm(total=steps, desc="bench", unit="run") as bar:
        def tick(msg):
            bar.set_postfix_str(msg)
            bar.update(1)

        result = run_bench(engine, workloads, quick=args.quick, progress=tick, agent_sizes=agent_sizes,
                           longctx_sizes=longctx_sizes, memory_sizes=_memory_sizes(args),
                           peer_batch=getattr(args, "peer_batch", None), context=getattr(args, "context", None),
                           concurrency=getattr(args, "concurrency", None))
        if on_ray:
            from parallm_bench.ray_agents import run_ray_agents_workload

            result["workloads"]["agents_ray"] = run_ray_agents_workload(engine, agent_sizes, ray_replicas, tick)
    if trace is not None:  # the in-process engine's steps and requests (peers and servers run elsewhere)
        print(f"wrote {trace.stop()}")
    if shape is not None:
        result["env"]["shape"] = shape.as_dict()
    print(format_table(result))
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.json_path}")
    if getattr(args, "plot", None):
        from parallm_bench.plot import write_plots

        for path in write_plots(result, args.plot):
            print(f"wrote {path}")
    return 0


def _memory_sizes(args):
    from parallm_bench.memory import FULL_MEMORY, QUICK_MEMORY

    return QUICK_MEMORY if args.quick else FULL_MEMORY


def _sizes_from_args(args):
    """The agents / longctx sizes: the full or quick defaults with what the command line overrides."""
    from dataclasses import replace

    from parallm_bench.agents import FULL_AGENTS, QUICK_AGENTS
    from parallm_bench.longctx import FULL_LONGCTX, QUICK_LONGCTX

    agents = QUICK_AGENTS if args.quick else FULL_AGENTS
    over = {k: getattr(args, a) for k, a in (("agents", "agents"), ("rate", "agent_rate"),
                                             ("reply_tokens", "agent_reply_tokens"), ("seed", "seed"),
                                             ("min_turns", "agent_turns"), ("max_turns", "agent_turns"))
            if getattr(args, a, None) is not None}
    longctx = QUICK_LONGCTX if args.quick else FULL_LONGCTX
    if getattr(args, "longctx_tokens", None):
        longctx = replace(longctx, doc_tokens=args.longctx_tokens)
    return replace(agents, **over), longctx
