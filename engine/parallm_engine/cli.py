"""`parallm` command line: info, generate, demo, serve, pull, models, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from parallm_engine.runner import backend as _backend  # noqa: F401  (importing the package preloads BLAS first)
from parallm_engine.runner.weights_dtype import WEIGHTS_DTYPES


def _engine_config(args) -> dict:
    cfg = {}
    if getattr(args, "max_batch_size", None):
        cfg["max_batch_size"] = args.max_batch_size
    if getattr(args, "no_prefix_cache", False):
        cfg["enable_prefix_cache"] = False
    if getattr(args, "kv_memory", None) is not None:
        cfg["kv_memory"] = args.kv_memory
    if getattr(args, "kv_bits", None) is not None:
        cfg["kv_bits"] = args.kv_bits
    if getattr(args, "kv_disk", None) is not None:
        cfg["kv_disk"] = args.kv_disk
    if getattr(args, "session_ttl", None) is not None:
        cfg["session_ttl"] = args.session_ttl
    if getattr(args, "adapter", None):
        cfg["adapters"] = dict(args.adapter)
    if getattr(args, "kv_events", None):
        events = {"endpoint": args.kv_events}
        if args.kv_events_replay:
            events["replay_endpoint"] = args.kv_events_replay
        if args.kv_events_block_size is not None:
            events["block_size"] = args.kv_events_block_size
        cfg["kv_events"] = events
    if getattr(args, "distributed", None):
        cfg["distributed"] = args.distributed
        cfg["distributed_timeout"] = args.distributed_timeout
    return cfg


def _size(text: str) -> int:
    """``--kv-disk``: bytes with an optional unit (8GiB, 512MiB); 0 for off."""
    from parallm_engine import settings

    try:
        return settings.parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size such as 8GiB, or 0, got {text!r}") from None


def _adapter(text: str) -> tuple[str, str]:
    """``--adapter NAME=PATH``: a LoRA adapter served as the model ``NAME``."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


def _kv_memory(text: str):
    """``--kv-memory``: a fraction of device memory (0.3) or bytes with an optional unit (2GiB, 512MiB)."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    try:
        for unit, scale in units.items():
            if t.endswith(unit):
                return int(float(t[: -len(unit)]) * scale)
        value = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a fraction (0.3) or a size (2GiB), got {text!r}") from None
    return value if value <= 1 else int(value)


def cmd_info(args) -> int:
    from parallm_engine.runner.backend import backend_info
    from parallm_engine.models.loader import DEFAULT_MODEL_NAME, default_model_path, peek_sampling_defaults

    from parallm_engine.runner.backend import choose_backend
    from parallm_engine.kv.memory_budget import mlx_limits

    from parallm_engine.models.mlx_install import inspect_install

    install = inspect_install()
    info = backend_info()
    engine_backend = choose_backend()
    out = {"backend": info.as_dict(), "mlx_install": install.as_dict(),
           "gpu_visible": info.device in ("gpu", "cuda"), "engine_backend": engine_backend.as_dict(),
           "decode_lanes": engine_backend.decode_lanes, "cpu_kernels": engine_backend.cpu_kernels,
           "blas_threading": _backend.blas_threading() if info.device == "cpu" else ""}
    if info.device == "cpu":
        from parallm_engine import settings
        from parallm_engine.runner import batch_invariance

        out["batch_invariant"] = (batch_invariance.blas_verdict().describe() if settings.batch_invariant()
                                  else "off (PARALLM_BATCH_INVARIANT=0)")
    from parallm_engine.errors import ParaLLMError
    from parallm_engine.runner.weights_dtype import resolve_weights_dtype

    try:
        out["weights_dtype"] = resolve_weights_dtype(None, info.device) or "the model's"
    except ParaLLMError as exc:
        out["weights_dtype"] = f"error: {exc}"
    kv_budget = engine_backend.kv_budget(getattr(args, "kv_memory", None))
    from parallm_engine.kv.kv_quant import resolve_kv_bits

    try:
        kv_bits = resolve_kv_bits(None)
    except ParaLLMError as exc:
        kv_bits = f"error: {exc}"
    from parallm_engine.kv.kv_pages import PAGE

    out["memory"] = {"device_bytes": engine_backend.memory_bytes, "source": engine_backend.memory_source,
                     "kv_budget_bytes": kv_budget, "kv_bits": kv_bits, "kv_page_tokens": PAGE,
                     "mlx_limits": mlx_limits(engine_backend.device, engine_backend.memory_bytes, kv_budget, 0)}
    if out["cpu_kernels"]:
        from parallm_engine import native

        out["native_kernels"] = native.status()
    try:
        out["default_model"] = {"name": DEFAULT_MODEL_NAME, "gguf": str(default_model_path())}
    except Exception as exc:
        out["default_model"] = {"error": str(exc)}
    # What a request that sets no temperature / top_p / top_k / min_p / repetition_penalty samples with.
    values, source = peek_sampling_defaults(args.model)
    out["sampling_defaults"] = {"values": values, "source": source}
    out["cycle_guard"] = _CYCLE_GUARD
    if getattr(args, "distributed", None):  # under mlx.launch: the ranks load their shards; rank 0 reports
        from parallm_engine.core.engine import Engine

        engine = Engine(args.model, distributed=args.distributed, kv_disk=0)
        out["distributed"] = engine.dist.describe()
        engine.shutdown()
    if args.model is not None or args.load:
        from parallm_engine.models.loader import load_model

        _, _, minfo = load_model(args.model)
        out["model"] = {
            "name": minfo.name, "path": str(minfo.path), "dtype": minfo.dtype,
            "context_window": minfo.context_window, "layers": minfo.num_layers,
            "kv_bytes_per_token": minfo.kv_bytes_per_token(),
        }
        out["sampling_defaults"] = {"values": minfo.sampling_defaults, "source": minfo.sampling_defaults_source}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    b = info
    print(f"backend : {b.device} ({b.platform}), mlx {b.mlx_version}")
    print(f"mlx lib : {install.summary()}; GPU {'visible' if out['gpu_visible'] else 'not visible'} to MLX")
    if install.problem:
        print(f"warning : {install.problem}")
    print(f"dtype   : {b.dtype}  (weights run in this dtype on this backend)")
    if b.device == "cpu":
        print(f"weights : stored {out['weights_dtype']} (Engine(weights_dtype=\"bfloat16\") or "
              "PARALLM_WEIGHTS_DTYPE=bfloat16: half the bytes per decode step; activations and KV stay float32)")
        from parallm_engine.runner.weights_dtype import bf16_dot_kernel

        print("          bfloat16-matmul (bf16 matmul inputs, float32 sums): "
              + ("AVX512_BF16 kernel" if bf16_dot_kernel() is not None else "MLX ops (no AVX512_BF16 kernel here)"))
    print(f"blas    : {b.blas}" + (f" ({out['blas_threading']})" if out["blas_threading"] else ""))
    if "batch_invariant" in out:
        print(f"          batch-invariant rows (a row's bits whatever shares its batch): {out['batch_invariant']}")
    print(f"engine  : {engine_backend.summary()}")
    print(f"lanes   : {out['decode_lanes']} decode lane(s); engine CPU kernels {'on' if out['cpu_kernels'] else 'off'}")
    mem = out["memory"]
    print(f"memory  : {mem['device_bytes'] / 2**30:.1f} GiB ({mem['source']}); KV budget "
          f"{mem['kv_budget_bytes'] / 2**30:.1f} GiB shared by running requests and the prefix cache "
          "(--kv-memory / Engine(kv_memory=))")
    bits = mem["kv_bits"]
    stored = f"at {bits} bits" if isinstance(bits, int) else bits or "unquantized"
    print(f"          KV stored {stored} (--kv-bits 8|4 / Engine(kv_bits=) / PARALLM_KV_BITS), "
          f"running rows in pages of {mem['kv_page_tokens']} tokens")
    limits = ", ".join(f"{k} {v / 2**30:.1f} GiB" + (" + the weights" if k == "wired" else "")
                       for k, v in mem["mlx_limits"].items())
    print(f"          MLX limits: {limits}")
    if "native_kernels" in out:
        nk = out["native_kernels"]
        detail = f"{nk['path']} ({nk['threads']} threads)" if nk["available"] else f"unavailable: {nk['reason']}"
        print(f"native  : {detail}")
    if b.device == "cpu" and b.blas.startswith("reference"):
        print(f"          {_backend.LATE_IMPORT_HINT if _backend._preload_too_late else _backend.BLAS_FIX_HINT}")
    if "distributed" in out:
        d = out["distributed"]
        print(f"ranks   : {d['size']} ({d['mode']} over {d['backend']}; {d['sharding']}, {d['num_layers']} layers)")
        for r in d["ranks"]:
            print(f"          rank {r['rank']}: layers {r['layers'][0]}-{r['layers'][1] - 1}, weights "
                  f"{r['weights_bytes'] / 2**20:.1f} MiB, MLX active {r['mlx_active_bytes'] / 2**20:.1f} MiB")
        load = (d.get("comm") or {}).get("at_load") or {}
        if load:
            print(f"          communication per forward: {1000 * load['decode_1_row_s']:.2f} ms for one decode row, "
                  f"{1000 * load['prefill_128_tokens_s']:.2f} ms for a 128-token prefill chunk")
    dm = out["default_model"]
    print(f"default : {dm.get('name', '')} {dm.get('gguf', dm.get('error', ''))}")
    if "model" in out:
        m = out["model"]
        print(f"model   : {m['name']} [{m['dtype']}, ctx {m['context_window']}, {m['layers']} layers] at {m['path']}")
    print(f"sampling: {_describe_sampling(out['sampling_defaults'])}")
    print(f"guard   : {_CYCLE_GUARD}")
    return 0


_CYCLE_GUARD = ("a request that sets no max_tokens stops when it repeats one block of tokens over and over "
                "(finish_reason length; see parallm_engine/sampling/repetition_guard.py)")


def _describe_sampling(defaults: dict) -> str:
    """One line: what requests that set no sampling settings use, and where it comes from."""
    from parallm_engine.sampling.sampling_params import SamplingParams

    values = defaults["values"]
    if not values:
        base = SamplingParams()
        return (f"temperature {base.temperature:g}, top_p {base.top_p:g} for requests that set none "
                "(engine defaults: the model recommends nothing)")
    shown = ", ".join(f"{k} {v:g}" for k, v in values.items())
    note = ("; repetition_penalty for sampled requests only: temperature 0 stays plain greedy"
            if "repetition_penalty" in values else "")
    return (f"{shown} for requests that set none (explicit settings win{note})\n"
            f"          from {defaults['source']}")


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.file:
        with open(args.file, encoding="utf-8") as fh:
            prompts += [line.rstrip("\n") for line in fh if line.strip()]
    if not prompts:
        raise SystemExit("give a prompt or --file")
    return prompts


def cmd_generate(args) -> int:
    from parallm_engine.core.registry import get_engine

    eng = get_engine(args.model, **_engine_config(args))
    prompts = _read_prompts(args)
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p

    def render(p):
        return eng.apply_chat_template([{"role": "user", "content": p}]) if not args.raw else p

    if len(prompts) == 1:
        for delta in eng.stream(render(prompts[0]), **sampling):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    # Many prompts: all in flight at once, printed as each finishes.
    t0 = time.monotonic()
    results = eng.generate([render(p) for p in prompts], **sampling)
    for p, r in zip(prompts, results):
        print(f"### {p}\n{r.text}\n")
    dt = time.monotonic() - t0
    toks = sum(r.usage.completion_tokens for r in results)
    print(f"[{len(prompts)} prompts, {toks} tokens in {dt:.1f}s = {toks / dt:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from parallm_bench.demo import main as demo_main

    args.engine_config = _engine_config(args)
    return demo_main(args)


def cmd_serve(args) -> int:
    from parallm_engine.serve.ray_launch import check_ray_arguments
    from parallm_engine.serve.server import serve

    check_ray_arguments(args)
    cfg = _engine_config(args)
    if args.max_queue:
        cfg["max_queue"] = args.max_queue
    if getattr(args, "ray", False):  # replicas on Ray Serve behind one front (serve/ray_serve.py; the `ray` extra)
        from parallm_engine.serve.ray_launch import serve_on_ray

        serve_on_ray(args.model, host=args.host, port=args.port, ray_address=args.ray_address,
                     replicas=args.replicas or 2, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                     target_ongoing_requests=args.target_ongoing_requests, routing=args.routing,
                     replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus, api_key=args.api_key,
                     served_model_name=args.served_model_name, expose_docs=args.expose_docs,
                     max_request_share=args.max_request_share, max_key_share=args.max_key_share, engine_config=cfg)
        return 0
    serve(model=args.model, host=args.host, port=args.port, api_key=args.api_key,
          served_model_name=args.served_model_name, log_level=args.log_level, expose_docs=args.expose_docs,
          max_request_share=args.max_request_share, max_key_share=args.max_key_share,
          embedding_model=args.embedding_model, rerank_model=args.rerank_model, **cfg)
    return 0


def cmd_top(args) -> int:
    from parallm_engine import settings
    from parallm_engine.serve.live_top import run_top

    keys = [args.api_key] if args.api_key else settings.api_keys()
    return run_top(args.url, api_key=keys[0] if keys else None, interval=args.interval)


def cmd_pull(args) -> int:
    from parallm_engine.models.hub import fetch_model
    from parallm_engine.models.model_store import describe_model_dir, pull_report

    path = fetch_model(args.model_id)  # huggingface_hub's progress bars on stderr
    entry = describe_model_dir(path, args.model_id, "hf-cache")
    print(json.dumps(entry.as_dict(), indent=2) if args.json else pull_report(entry))
    return 0 if entry.runs else 1


def cmd_models(args) -> int:
    from parallm_engine.models.model_store import all_models, table

    entries = all_models()
    print(json.dumps([e.as_dict() for e in entries], indent=2) if args.json else table(entries))
    return 0


def cmd_cache(args) -> int:
    from parallm_engine.kv.disk_store import DiskStore
    from parallm_engine.kv.disk_tier import default_root

    root = default_root()
    store = DiskStore(root, cap_bytes=0) if root.exists() else None
    if args.clear:
        freed = store.clear(args.model) if store is not None else 0
        print(f"deleted {freed / 2**20:.1f} MiB of KV blocks from {root}")
        return 0
    models = store.models() if store is not None else []
    if args.json:
        print(json.dumps({"root": str(root), "models": models}, indent=2))
        return 0
    print(f"prefix cache on disk: {root}")
    if not models:
        print("  (empty)")
    for m in models:
        print(f"  {m['fingerprint'][:12]}  {m['blocks']:6d} blocks  {m['bytes'] / 2**20:9.1f} MiB  "
              f"{m.get('model', '?')} ({m.get('backend', '?')})")
    return 0


def cmd_bench(args) -> int:
    from parallm_bench.bench import main as bench_main

    return bench_main(args)


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.2 <= value <= 60:
        raise argparse.ArgumentTypeError("must be between 0.2 and 60 seconds")
    return value


def _share(text: str) -> float:
    """A share of the engine queue: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parallm", description="Many LLM calls in parallel on one local MLX model.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add_model(sp):
        sp.add_argument("--model", default=None, help="a Hugging Face model id (org/name[@revision], downloaded once), a GGUF file or an "
                             "HF/MLX model directory (default: SmolLM2-135M)")
        sp.add_argument("--max-batch-size", type=int, default=None)
        sp.add_argument("--no-prefix-cache", action="store_true")
        sp.add_argument("--kv-memory", type=_kv_memory, default=None, metavar="F|SIZE",
                        help="KV budget shared by running requests and the prefix cache: a fraction of "
                             "device memory or a size such as 4GiB (default 0.25)")
        sp.add_argument("--kv-bits", type=int, choices=(4, 8), default=None,
                        help="store the KV cache at 8 or 4 bits (about 3.6x / 6.4x less KV memory than "
                             "float32; default: unquantized; PARALLM_KV_BITS)")
        sp.add_argument("--kv-disk", type=_size, default=None, metavar="SIZE",
                        help="the prefix cache's disk tier: its size cap (e.g. 8GiB), 0 turns it off (default: "
                             "on, 16 GiB or a tenth of the free disk; PARALLM_KV_DISK; `parallm cache` lists it)")
        sp.add_argument("--session-ttl", type=float, default=None, metavar="SECONDS",
                        help="seconds a session's context stays pinned after its turn (default 30; 0 turns "
                             "sessions off; docs/memory.md)")
        sp.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                        help="publish what the prefix cache holds as vLLM-format KV events on this ZMQ endpoint "
                             "(e.g. tcp://*:5557) for prefix-aware routers (llm-d, Dynamo); needs pyzmq, msgspec")
        sp.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                        help="with --kv-events: a ZMQ ROUTER endpoint that replays missed event batches")
        sp.add_argument("--kv-events-block-size", type=int, default=None, metavar="N",
                        help="with --kv-events: tokens per block (default 16; the router must use the same)")
        sp.add_argument("--distributed", choices=("pipeline", "tensor"), default=None,
                        help="one model over the ranks of mlx.launch (e.g. `mlx.launch -n 2 --backend ring -- "
                             "parallm serve --distributed pipeline`): rank 0 serves, the others follow it "
                             "(docs/distributed.md)")
        sp.add_argument("--distributed-timeout", type=float, default=90.0, metavar="S",
                        help="with --distributed: a step waiting this long on another rank ends every request "
                             "with a rank_lost error (503)")

    sp = sub.add_parser("info", help="backend, dtype and BLAS in use; the default model")
    sp.add_argument("--model", default=None)
    sp.add_argument("--load", action="store_true", help="also load the model and describe it")
    sp.add_argument("--distributed", choices=("pipeline", "tensor"), default=None,
                    help="under mlx.launch: split the model over the ranks and report each rank's share")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_info)

    sp = sub.add_parser("generate", help="generate for one prompt (streamed) or a file of prompts (batched)")
    add_model(sp)
    sp.add_argument("prompt", nargs="*")
    sp.add_argument("--file", help="one prompt per line")
    sp.add_argument("--max-tokens", type=int, default=128)
    sp.add_argument("--temperature", type=float, default=None,
                    help="default: the model's recommendation, see `parallm info` (0 = greedy)")
    sp.add_argument("--top-p", type=float, default=None)
    sp.add_argument("--seed", type=int, default=None)
    sp.add_argument("--raw", action="store_true", help="do not apply the chat template")
    sp.set_defaults(fn=cmd_generate)

    sp = sub.add_parser("demo", help="fan out many prompts on the default model; compare with one at a time")
    add_model(sp)
    sp.add_argument("-n", type=int, default=32, help="prompts in parallel")
    sp.add_argument("--max-tokens", type=int, default=48)
    sp.add_argument("--sequential", type=int, default=4,
                    help="how many of the same prompts to run one at a time for the baseline (-n: all of them)")
    sp.add_argument("--show", type=int, default=3, help="answers to print")
    sp.set_defaults(fn=cmd_demo)

    sp = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server on the shared engine",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="OpenAI-compatible HTTP server on the shared engine.",
        epilog="limits:\n"
               "  queue shares are counted in sequences (prompts x n) of --max-queue:\n"
               "  one request may hold at most --max-request-share of it (more: 400 too_many_sequences);\n"
               "  with several keys, one key at most --max-key-share (more: 429 + Retry-After, other keys\n"
               "  are still served); the whole queue full: 429 queue_full + Retry-After.\n"
               "  Bodies over 32 MiB: 413. Text with lone UTF-16 surrogates: 400. max_tokens is clamped to\n"
               "  what the context window leaves after the prompt.\n"
               "special tokens:\n"
               "  special-token text in chat messages is plain text unless a request sets\n"
               "  allow_special_tokens=true; /v1/completions prompts are raw model input (parsed, as in vLLM)\n"
               "  unless a request sets allow_special_tokens=false.")
    add_model(sp)
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument("--api-key", action="append", default=None, metavar="KEY",
                    help="require this key; repeat for several clients, each with its own queue share "
                         "(default: $PARALLM_API_KEYS, comma-separated, and $PARALLM_API_KEY, else none)")
    sp.add_argument("--expose-docs", action="store_true",
                    help="serve /docs, /redoc and /openapi.json without a key (with a key they need one)")
    sp.add_argument("--max-queue", type=int, default=None, help="requests in flight before 429 (default 1024)")
    sp.add_argument("--max-request-share", type=_share, default=0.25, metavar="F",
                    help="most of the queue, in sequences, one request may take (default 0.25)")
    sp.add_argument("--max-key-share", type=_share, default=0.5, metavar="F",
                    help="most of the queue, in sequences, one API key may hold when there are several "
                         "(default 0.5)")
    sp.add_argument("--served-model-name", default=None)
    sp.add_argument("--embedding-model", default=None, metavar="MODEL",
                    help="answer /v1/embeddings with this model (a decoder or a BERT-family encoder) instead of "
                         "the served one (docs/embeddings.md)")
    sp.add_argument("--rerank-model", default=None, metavar="MODEL",
                    help="answer /v1/rerank, /rerank and /v2/rerank with this model (a cross-encoder such as "
                         "bge-reranker, or Qwen3-Reranker) instead of the served one (docs/rerank.md)")
    sp.add_argument("--adapter", type=_adapter, action="append", default=None, metavar="NAME=PATH",
                    help="serve a LoRA adapter (mlx-lm's or PEFT's directory, or a cached HF repo id) as the model "
                         "NAME: requests naming it run under it, in one batch with every other; repeatable")
    sp.add_argument("--log-level", default="info")
    ray = sp.add_argument_group("replicas on Ray Serve (pip install 'parallm-engine[ray]'; docs/scale-out.md)")
    ray.add_argument("--ray", action="store_true",
                     help="serve N replicas of the engine on Ray Serve behind one front on --port that routes "
                          "by cached prefix and session")
    ray.add_argument("--replicas", type=int, default=None, metavar="N", help="with --ray: replicas (default 2)")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="with --ray: join this Ray cluster (auto, host:6379, ray://host:10001) instead of "
                          "starting a local instance")
    ray.add_argument("--min-replicas", type=int, default=None, metavar="A",
                     help="with --ray and --max-replicas: autoscale on requests in flight between A and B")
    ray.add_argument("--max-replicas", type=int, default=None, metavar="B")
    ray.add_argument("--target-ongoing-requests", type=float, default=32.0, metavar="N",
                     help="with --max-replicas: requests in flight per replica the autoscaler aims at (default 32)")
    ray.add_argument("--routing", choices=("prefix", "round_robin"), default="prefix",
                     help="with --ray: longest cached prefix / session / least loaded (default), or round robin")
    ray.add_argument("--replica-cpus", type=float, default=1.0, metavar="N",
                     help="with --ray: Ray CPUs each replica takes (default 1)")
    ray.add_argument("--replica-gpus", type=float, default=0.0, metavar="N",
                     help="with --ray: Ray GPUs each replica takes (1: one replica per GPU; default 0)")
    sp.set_defaults(fn=cmd_serve)

    sp = sub.add_parser("top", help="the live view of a running server in this terminal (q quits)")
    sp.add_argument("--url", default="http://127.0.0.1:8000", help="the server (parallm serve, or serve_dashboard)")
    sp.add_argument("--api-key", default=None, help="its API key (default: $PARALLM_API_KEYS / $PARALLM_API_KEY)")
    sp.add_argument("--interval", type=_interval, default=1.0, help="seconds between updates (0.2 to 60)")
    sp.set_defaults(fn=cmd_top)

    sp = sub.add_parser("pull", help="download a Hugging Face model (org/name[@revision]) and say what it is")
    sp.add_argument("model_id")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_pull)

    sp = sub.add_parser("models", help="the models on this machine (HF cache, LM Studio, Ollama) and which run")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_models)

    sp = sub.add_parser("cache", help="what the prefix cache's disk tier holds, per model; --clear empties it")
    sp.add_argument("--clear", action="store_true", help="delete the stored blocks (of --model only, if given)")
    sp.add_argument("--model", default=None, help="a fingerprint (or its first characters) from the listing")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_cache)

    sp = sub.add_parser("bench", help="benchmark against mlx-lm (and transformers) in one run")
    add_model(sp)
    sp.add_argument("--workloads", default=None,
                    help="comma-separated (default throughput,fanout,single,peer,roofline,paths,arrival; with "
                         "--shape throughput,fanout,single); also llamacpp, agents, longctx, memory (long runs), spec (speculative decoding), "
                         "constrained (JSON-schema rows vs free rows), preempt (the batch under a KV budget of half its KV), "
                         "vision (8 requests on one image, a random SmolVLM-256M-shaped VLM), "
                         "embed (texts/s at 1/16/64 concurrent vs one at a time, and beside generation), "
                         "curve (TPOT vs aggregate tok/s at 1-64 concurrent, ParaLLM on both paths and mlx-lm; "
                         "--plot DIR writes curve.csv / curve.svg, and a PNG with matplotlib), "
                         "soak (alone: a server under mixed traffic and faults for --minutes; bench_soak.py). "
                         "llamacpp (and agents' llama.cpp system) need llama-server: "
                         "python -m parallm_bench.llamacpp build")
    sp.add_argument("--path", choices=("native", "mlx"), default="native",
                    help="mlx: run on MLX's own ops (backend cpu-mlx, the path Metal and CUDA take) and "
                         "compare the fan-out with the native path (the 'paths' workload)")
    sp.add_argument("--quick", action="store_true", help="small sizes, < 3 minutes")
    sp.add_argument("--weights-dtype", choices=WEIGHTS_DTYPES, default=None,
                    help="CPU weight storage for ParaLLM's engine (default float32; bfloat16 halves the bytes "
                         "a decode step streams; bfloat16-matmul also rounds matmul inputs to bf16, AVX512_BF16's "
                         "kernel where the CPU has it; the peer table's row becomes parallm_bf16)")
    sp.add_argument("--context", type=int, default=None, metavar="TOKENS",
                    help="throughput prompts' length and the fan-out's shared prefix (default 100 / 512; "
                         "e.g. 1000 or 4000)")
    sp.add_argument("--concurrency", type=int, default=None, metavar="N",
                    help="requests in flight in throughput and fanout (default 32; e.g. 8 or 64)")
    sp.add_argument("--json", dest="json_path", default=None, help="write results as JSON here")
    sp.add_argument("--ranks", type=int, default=2,
                    help="with --distributed: the model on 1 rank and on this many ranks of mlx.launch (ring, this "
                         "machine): tok/s, each rank's weights, the control messages' share (default 2)")
    sp.add_argument("--agents", type=int, default=None, help="agents: how many simulated agents (default 16)")
    sp.add_argument("--agent-rate", type=float, default=None, help="agents: Poisson arrivals per second (default 1)")
    sp.add_argument("--agent-reply-tokens", type=int, default=None, help="agents: tokens per reply (default 24)")
    sp.add_argument("--seed", type=int, default=None, help="agents: the trace's seed (default 2024)")
    sp.add_argument("--agent-turns", type=int, default=None, metavar="N",
                    help="agents: every agent runs exactly N turns (default 4-6)")
    sp.add_argument("--ray-replicas", type=int, default=None, metavar="N",
                    help="agents: run the trace through `parallm serve --ray` on a local Ray instance instead: "
                         "1 replica, N replicas routed by prefix, N round robin, and N with a replica killed "
                         "(pip install 'parallm-engine[ray]'; parallm_bench/ray_agents.py)")
    sp.add_argument("--peer-batch", type=int, default=None, metavar="N",
                    help="peer: N prompts of 32 tokens, 48 new tokens (the batch-64 decode check: --peer-batch 64) "
                         "instead of the throughput workload's prompts")
    sp.add_argument("--longctx-tokens", type=int, default=None, help="longctx: document tokens (default 8000)")
    sp.add_argument("--shape", choices=("qwen3-4b", "llama3-8b", "gemma3-4b", "smollm2-135m"), default=None,
                    help="run on a random-weight model with this architecture's exact config (layers cut to "
                         "fit --shape-budget-gb; see parallm_bench/shapes.py)")
    sp.add_argument("--shape-layers", type=int, default=None, help="--shape: keep this many layers")
    sp.add_argument("--shape-budget-gb", type=float, default=None,
                    help="--shape: fp32 weight GB a decode step may read, which sets the layers kept (default 3)")
    sp.add_argument("--plot", default=None, metavar="DIR",
                    help="write matplotlib PNGs of the results here (pip install matplotlib)")
    sp.add_argument("--trace", default=None, metavar="PATH",
                    help="write a Chrome / Perfetto trace (ui.perfetto.dev) of ParaLLM's in-process engine during "
                         "the run here: its steps and each request's queue / prefill / decode (docs/tracing.md)")
    from parallm_bench.soak import add_arguments as add_soak_arguments

    add_soak_arguments(sp)  # --workloads soak: --minutes, --interval, --soak-target, --soak-kv-memory
    sp.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from parallm_engine.errors import ParaLLMError

    try:
        return args.fn(args) or 0
    except ParaLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
