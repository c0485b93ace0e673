"""The ``observe`` workload of `parallm bench`: what watching the engine costs.

The throughput and fan-out workloads' prompts (their sizes), run alternately with nothing watching and with
everything on: the live page served (``serve/live_server.serve_dashboard``) with a client reading its
``/v1/status/stream`` all along, and OpenTelemetry spans for every request (an SDK tracer provider exporting
to memory through a ``BatchSpanProcessor``, as the docs advise; ``PARALLM_OTEL`` switches it per run).
``reps`` runs of each, alternating; reported: the median tok/s of each and ``observed / off`` (1.0: free),
the spans exported and the stream's snapshots read (so the "on" runs did watch).

JSON::

    {"throughput": {"off_tok_s", "on_tok_s", "ratio", "runs_off", "runs_on"}, "fanout": {...},
     "spans": N, "snapshots": N, "tracing": true | "not installed: ..."}
"""

from __future__ import annotations

import os
import random
import statistics
import threading

from parallm_bench.bench import _prompts, run_parallm


def _watcher(url: str, stop: threading.Event, seen: list) -> threading.Thread:
    """A client of the live page's event stream until ``stop``: it counts the snapshots it reads."""
    import httpx

    def read():
        while not stop.is_set():
            try:
                with httpx.stream("GET", url, timeout=5.0) as r:
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            seen[0] += 1
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                stop.wait(0.2)

    t = threading.Thread(target=read, name="bench-observe-watcher", daemon=True)
    t.start()
    return t


def _tracing():
    """An SDK tracer provider exporting to memory (set once for the process), or the reason it cannot be."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    except ImportError as exc:
        return None, f"not installed: {exc} (pip install 'parallm-engine[otel]')"
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return (provider, exporter), True


def run_observe(engine, sizes, tick=None, reps: int = 3) -> dict:
    from parallm_engine.serve.live_server import serve_dashboard, stop_dashboard

    tick = tick or (lambda msg: None)
    vocab = engine.model_info.vocab_size
    rng = random.Random(4321)
    prefix = _prompts(rng, 1, sizes.prefix_len, vocab)[0]
    workloads = {"throughput": (_prompts(rng, sizes.n, sizes.prompt_len, vocab), sizes.new_tokens),
                 "fanout": ([prefix + s for s in _prompts(rng, sizes.n, sizes.suffix_len, vocab)], sizes.fan_new)}
    traced, tracing = _tracing()
    url = serve_dashboard(engine).removesuffix("/dashboard") + "/v1/status/stream"
    seen = [0]
    before = os.environ.get("PARALLM_OTEL")
    out: dict = {"tracing": tracing}
    try:
        for name, (prompts, new) in workloads.items():
            runs = {"off": [], "on": []}
            for rep in range(reps):
                for mode in ("off", "on"):
                    tick(f"observe: {name} {mode} ({rep + 1}/{reps})")
                    os.environ["PARALLM_OTEL"] = "1" if mode == "on" and traced else "0"
                    stop = threading.Event()
                    watcher = _watcher(url, stop, seen) if mode == "on" else None
                    runs[mode].append(run_parallm(engine, prompts, new)["tok_s"])
                    stop.set()
                    if watcher is not None:
                        watcher.join(timeout=10)
            off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
            out[name] = {"off_tok_s": off, "on_tok_s": on, "ratio": round(on / off, 3) if off else None,
                         "runs_off": runs["off"], "runs_on": runs["on"]}
    finally:
        if before is None:
            os.environ.pop("PARALLM_OTEL", None)
        else:
            os.environ["PARALLM_OTEL"] = before
        stop_dashboard(engine)
    if traced:
        traced[0].force_flush()
        out["spans"] = len(traced[1].get_finished_spans())
    out["snapshots"] = seen[0]
    return out


def format_lines(r: dict) -> list[str]:
    lines = [f"observe: the live page watched over its event stream and OpenTelemetry spans on (tracing: "
             f"{r['tracing']}), alternating with both off; {r.get('spans', 0)} spans, {r['snapshots']} snapshots read"]
    for name in ("throughput", "fanout"):
        e = r[name]
        lines.append(f"  {name:10}: off {e['off_tok_s']:.1f} tok/s, on {e['on_tok_s']:.1f} tok/s: on / off "
                     f"{e['ratio']}x (runs off {e['runs_off']}, on {e['runs_on']})")
    return lines
