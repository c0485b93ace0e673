"""`parallm` command line: info, generate, demo, serve, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from . import backend as _backend  # noqa: F401  (importing the package preloads BLAS first)

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a short poem about the sea.",
    "Explain in one sentence what a language model is.",
    "What are the primary colors?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "Name three planets in our solar system.",
    "How do plants make their food?",
    "What is the boiling point of water?",
    "Suggest a name for a friendly robot.",
    "What does a librarian do?",
    "Give a tip for learning a new language.",
    "What is the largest ocean on Earth?",
    "Write a haiku about autumn leaves.",
    "Why do we need sleep?",
    "What is photosynthesis?",
    "List three fruits that are red.",
    "How many days are there in a leap year?",
    "What is the opposite of hot?",
    "Describe the taste of a lemon.",
    "What is a volcano?",
    "Give one reason to exercise.",
    "What language is spoken in Brazil?",
    "What is the tallest animal?",
    "How do bees help flowers?",
    "Tell me a fun fact about octopuses.",
    "What is gravity?",
    "Write a sentence using the word 'bright'.",
    "What is the freezing point of water in Fahrenheit?",
    "Why do leaves change colour in autumn?",
    "What is the main ingredient of bread?",
]


def _engine_config(args) -> dict:
    cfg = {}
    if getattr(args, "max_batch_size", None):
        cfg["max_batch_size"] = args.max_batch_size
    if getattr(args, "no_prefix_cache", False):
        cfg["enable_prefix_cache"] = False
    return cfg


def cmd_info(args) -> int:
    from .backend import backend_info
    from .loader import DEFAULT_MODEL_NAME, default_model_path

    from .engine import _default_cpu_kernels, _default_decode_lanes

    info = backend_info()
    out = {"backend": info.as_dict(), "decode_lanes": _default_decode_lanes(), "cpu_kernels": _default_cpu_kernels()}
    if out["cpu_kernels"]:
        from . import native

        out["native_kernels"] = native.status()
    try:
        out["default_model"] = {"name": DEFAULT_MODEL_NAME, "gguf": str(default_model_path())}
    except Exception as exc:
        out["default_model"] = {"error": str(exc)}
    if args.model is not None or args.load:
        from .loader import load_model

        _, _, minfo = load_model(args.model)
        out["model"] = {
            "name": minfo.name, "path": str(minfo.path), "dtype": minfo.dtype,
            "context_window": minfo.context_window, "layers": minfo.num_layers,
            "kv_bytes_per_token": minfo.kv_bytes_per_token(4 if minfo.dtype == "float32" else 2),
        }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    b = info
    print(f"backend : {b.device} ({b.platform}), mlx {b.mlx_version}")
    print(f"dtype   : {b.dtype}  (weights run in this dtype on this backend)")
    print(f"blas    : {b.blas}")
    print(f"lanes   : {out['decode_lanes']} decode lane(s); engine CPU kernels {'on' if out['cpu_kernels'] else 'off'}")
    if "native_kernels" in out:
        nk = out["native_kernels"]
        detail = f"{nk['path']} ({nk['threads']} threads)" if nk["available"] else f"unavailable: {nk['reason']}"
        print(f"native  : {detail}")
    if b.device == "cpu" and b.blas.startswith("reference"):
        print(f"          {_backend.LATE_IMPORT_HINT if _backend._preload_too_late else _backend.BLAS_FIX_HINT}")
    dm = out["default_model"]
    print(f"default : {dm.get('name', '')} {dm.get('gguf', dm.get('error', ''))}")
    if "model" in out:
        m = out["model"]
        print(f"model   : {m['name']} [{m['dtype']}, ctx {m['context_window']}, {m['layers']} layers] at {m['path']}")
    return 0


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.file:
        with open(args.file, encoding="utf-8") as fh:
            prompts += [line.rstrip("\n") for line in fh if line.strip()]
    if not prompts:
        raise SystemExit("give a prompt or --file")
    return prompts


def cmd_generate(args) -> int:
    from .registry import get_engine

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
    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    from .registry import get_engine

    console = Console()
    t_load = time.monotonic()
    eng = get_engine(args.model, **_engine_config(args))
    from .backend import backend_info

    console.print(f"[bold]ParaLLM demo[/] model={eng.model_name} {backend_info().summary()} "
                  f"(loaded in {time.monotonic() - t_load:.1f}s)")
    qs = (DEMO_QUESTIONS * ((args.n // len(DEMO_QUESTIONS)) + 1))[: args.n]
    prompts = [eng.apply_chat_template([{"role": "user", "content": q}]) for q in qs]
    sampling = {"max_tokens": args.max_tokens, "temperature": 0.0}
    eng.generate([prompts[0]], max_tokens=2, temperature=0.0)  # warm-up

    # Parallel: every prompt in flight at once; a live bar counts generated tokens.
    eng.reset_peaks()
    handles = [eng.submit(p, **sampling) for p in prompts]
    t0 = time.monotonic()
    texts = [""] * len(prompts)
    ttfts = [0.0] * len(prompts)
    done = 0
    with tqdm(total=args.n * args.max_tokens, unit="tok", desc=f"{args.n} prompts in parallel") as bar:
        import threading

        lock = threading.Lock()

        def drain(i, h):
            nonlocal done
            for d in h:
                with lock:
                    if not texts[i] and d.text and not ttfts[i]:
                        ttfts[i] = time.monotonic() - t0
                    texts[i] += d.text
                    bar.update(len(d.token_ids))
            with lock:
                done += 1

        threads = [threading.Thread(target=drain, args=(i, h)) for i, h in enumerate(handles)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    par_wall = time.monotonic() - t0
    results = [h.request.result for h in handles]
    par_tokens = sum(r.usage.completion_tokens for r in results)
    stats = eng.stats()

    # One by one, on a subset (sequential is slow), for the per-request baseline rate.
    n_seq = min(args.sequential, len(prompts))
    t1 = time.monotonic()
    seq_tokens = 0
    seq_ttft = []
    for p in tqdm(prompts[:n_seq], desc="one at a time (baseline)", unit="req"):
        r = eng.generate([p], **sampling)[0]
        seq_tokens += r.usage.completion_tokens
        seq_ttft.append(r.metrics["ttft"])
    seq_wall = time.monotonic() - t1

    for q, r in list(zip(qs, results))[: args.show]:
        console.print(f"[cyan]Q:[/] {q}\n[green]A:[/] {r.text.strip()[:200]}")
    par_tps = par_tokens / par_wall
    seq_tps = seq_tokens / seq_wall if seq_wall else 0.0
    table = Table(title=f"{args.n} prompts x {args.max_tokens} max new tokens, greedy")
    for col in ("mode", "requests", "tokens", "wall s", "tok/s", "TTFT p50 s", "peak in flight"):
        table.add_column(col, justify="right")
    ttft_sorted = sorted(r.metrics["ttft"] for r in results)
    table.add_row("parallel (ParaLLM)", str(args.n), str(par_tokens), f"{par_wall:.1f}", f"{par_tps:.1f}",
                  f"{ttft_sorted[len(ttft_sorted) // 2]:.2f}", str(stats["peak_in_flight"]))
    table.add_row("one at a time", str(n_seq), str(seq_tokens), f"{seq_wall:.1f}", f"{seq_tps:.1f}",
                  f"{sorted(seq_ttft)[len(seq_ttft) // 2]:.2f}", "1")
    console.print(table)
    if seq_tps:
        console.print(f"[bold]Aggregate speedup over one at a time: {par_tps / seq_tps:.1f}x[/] "
                      f"(prefix cache hit rate {stats['cache_hit_rate']:.0%})")
    return 0


def cmd_serve(args) -> int:
    from .server import serve

    cfg = _engine_config(args)
    if args.max_queue:
        cfg["max_queue"] = args.max_queue
    serve(model=args.model, host=args.host, port=args.port, api_key=args.api_key,
          served_model_name=args.served_model_name, log_level=args.log_level, **cfg)
    return 0


def cmd_bench(args) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parallm", description="Many LLM calls in parallel on one local MLX model.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add_model(sp):
        sp.add_argument("--model", default=None, help="GGUF file or HF/MLX model directory (default: SmolLM2-135M)")
        sp.add_argument("--max-batch-size", type=int, default=None)
        sp.add_argument("--no-prefix-cache", action="store_true")

    sp = sub.add_parser("info", help="backend, dtype and BLAS in use; the default model")
    sp.add_argument("--model", default=None)
    sp.add_argument("--load", action="store_true", help="also load the model and describe it")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_info)

    sp = sub.add_parser("generate", help="generate for one prompt (streamed) or a file of prompts (batched)")
    add_model(sp)
    sp.add_argument("prompt", nargs="*")
    sp.add_argument("--file", help="one prompt per line")
    sp.add_argument("--max-tokens", type=int, default=128)
    sp.add_argument("--temperature", type=float, default=0.0)
    sp.add_argument("--top-p", type=float, default=None)
    sp.add_argument("--seed", type=int, default=None)
    sp.add_argument("--raw", action="store_true", help="do not apply the chat template")
    sp.set_defaults(fn=cmd_generate)

    sp = sub.add_parser("demo", help="fan out many prompts on the default model; compare with one at a time")
    add_model(sp)
    sp.add_argument("-n", type=int, default=32, help="prompts in parallel")
    sp.add_argument("--max-tokens", type=int, default=48)
    sp.add_argument("--sequential", type=int, default=3, help="prompts run one at a time for the baseline")
    sp.add_argument("--show", type=int, default=3, help="answers to print")
    sp.set_defaults(fn=cmd_demo)

    sp = sub.add_parser("serve", help="OpenAI-compatible HTTP server on the shared engine")
    add_model(sp)
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument("--api-key", default=None, help="require this key (default: $PARALLM_API_KEY, else none)")
    sp.add_argument("--max-queue", type=int, default=None, help="requests in flight before 429")
    sp.add_argument("--served-model-name", default=None)
    sp.add_argument("--log-level", default="info")
    sp.set_defaults(fn=cmd_serve)

    sp = sub.add_parser("bench", help="benchmark against mlx-lm (and transformers) in one run")
    add_model(sp)
    sp.add_argument("--workloads", default="throughput,fanout,single,peer,roofline")
    sp.add_argument("--quick", action="store_true", help="small sizes, < 3 minutes")
    sp.add_argument("--json", dest="json_path", default=None, help="write results as JSON here")
    sp.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from .errors import ParaLLMError

    try:
        return args.fn(args) or 0
    except ParaLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
