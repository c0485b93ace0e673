"""`parallm bench --workloads soak --minutes N` (or ``python -m parallm_bench.soak``): hours, not minutes.

One ParaLLM server (``parallm serve`` in its own process, or the engine + app inside this process: ``--soak-target``)
is driven over loopback for N minutes by the seeded mix of soak_traffic.py, with a KV budget small enough that
preemption and prefix-cache eviction happen all the time and a queue small enough that bursts meet 429. Every
interval it records the server's memory (RSS, MLX active / cache / peak), the KV and page gauges, requests, errors
by status and the interval's TTFT / ITL percentiles, and re-sends fixed probes whose text must never change. At the
end the load stops, the prefix cache is cleared, and every counter must be back at its idle value (no page, pin,
request or thread left), RSS within ``rss_margin`` of where it stood after warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from parallm_bench.server_process import ServerExited, free_port, wait_healthy
from parallm_bench.soak_traffic import ADAPTER, Traffic, probe

#: Gauges read from /metrics each interval (metric name without the ``parallm_`` prefix -> report key).
GAUGES = {
    "mlx_active_memory_bytes": "mlx_active", "mlx_cache_memory_bytes": "mlx_cache", "mlx_peak_memory_bytes": "mlx_peak",
    "kv_held_bytes": "kv_held", "prefix_cache_bytes": "prefix_cache", "prefix_cache_pinned_bytes": "pinned",
    "kv_pages_used": "pages_used", "kv_pages_cached": "pages_cached", "kv_pages_free": "pages_free",
    "requests_in_flight": "in_flight", "requests_waiting": "waiting", "requests_prefilling": "prefilling",
    "engine_requests_finished_total": "finished", "preemptions_total": "preemptions",
    "prefix_cache_evictions_total": "evictions",
}
#: What must read zero once the load has stopped and the prefix cache is cleared.
IDLE_ZERO = ("in_flight", "waiting", "prefilling", "pinned", "prefix_cache", "pages_used", "pages_cached")


@dataclass
class SoakConfig:
    minutes: float = 30.0
    interval_s: float = 60.0
    seed: int = 2026
    workers: int = 10
    max_queue: int = 32
    kv_memory: str = "64MiB"  # the smallest a server takes: preemption and eviction all the time
    target: str = "server"  # "server": `parallm serve` subprocess; "inproc": the engine + app in this process
    model: str | None = None
    rss_margin: float = 0.25  # end RSS may exceed the post-warm-up RSS by this fraction (allocator slack)
    adapter: bool = True  # serve a random LoRA adapter for the model (local models only) and send traffic to it


@dataclass
class SoakResult:
    config: dict
    intervals: list[dict] = field(default_factory=list)
    probe_mismatches: list[dict] = field(default_factory=list)
    end_state: dict = field(default_factory=dict)
    warm_rss_mb: float = 0.0
    end_rss_mb: float = 0.0
    rss_slope_mb_per_min: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(n for iv in self.intervals for s, n in iv["status"].items() if int(s) >= 500)

    @property
    def clean(self) -> bool:
        return not self.end_state.get("problems")

    def as_dict(self) -> dict:
        return {**asdict(self), "server_errors": self.server_errors, "clean": self.clean}


# -- the server under test ---------------------------------------------------------------------

class _Target:
    """Starts the server; ``base_url`` and ``pid`` (whose RSS and threads are read) once up."""

    def __init__(self, cfg: SoakConfig):
        self.cfg = cfg
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.pid = os.getpid()
        self._server = None
        self.engine = None
        self.adapter_dir: str | None = None
        self._tmp = None

    def _write_adapter(self) -> None:
        """A random LoRA adapter for the model (``parallm_bench.lora``): a local directory, or the MLX directory
        a GGUF (the default model) is converted into."""
        import tempfile
        from pathlib import Path

        from parallm_bench.lora import write_random_adapter
        from parallm_engine.models.loader import resolve_model

        if not self.cfg.adapter:
            return
        base = resolve_model(self.cfg.model)[0]
        if not base.is_dir():
            return
        self._tmp = tempfile.TemporaryDirectory(prefix="parallm-soak-")
        self.adapter_dir = str(write_random_adapter(base, Path(self._tmp.name) / ADAPTER, rank=4, seed=5))

    def start(self) -> None:
        from parallm_engine.cli import _kv_memory

        self._write_adapter()
        if self.cfg.target == "server":
            cmd = [sys.executable, "-m", "parallm_engine.cli", "serve", "--port", str(self.port),
                   "--kv-memory", self.cfg.kv_memory, "--max-queue", str(self.cfg.max_queue), "--log-level", "warning"]
            if self.cfg.model:
                cmd += ["--model", self.cfg.model]
            if self.adapter_dir:
                cmd += ["--adapter", f"{ADAPTER}={self.adapter_dir}"]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self.pid = self.proc.pid
        else:
            import uvicorn

            from parallm_engine.core.engine import Engine
            from parallm_engine.serve.server import create_app

            kv = _kv_memory(self.cfg.kv_memory)
            self.engine = Engine(self.cfg.model, max_queue=self.cfg.max_queue,
                                 adapters={ADAPTER: self.adapter_dir} if self.adapter_dir else None,
                                 **({"kv_budget_bytes": kv} if isinstance(kv, int) else {"kv_memory": kv}))
            config = uvicorn.Config(create_app(engine=self.engine), host="127.0.0.1", port=self.port,
                                    log_level="warning", lifespan="on")
            self._server = uvicorn.Server(config)
            threading.Thread(target=self._server.run, daemon=True, name="soak-uvicorn").start()
        self._wait_healthy()

    def _wait_healthy(self, timeout: float = 300.0) -> None:
        try:
            wait_healthy(self.base_url, self.proc, timeout, interval=0.5, name="the soak's server")
        except ServerExited:
            raise RuntimeError(f"parallm serve exited: {self.proc.stderr.read().decode()[-2000:]}") from None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self._server is not None:
            self._server.should_exit = True
            time.sleep(1.0)
        if self.engine is not None:
            self.engine.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()


def _proc_status(pid: int) -> dict:
    """RSS (MB) and thread count of ``pid`` from /proc (Linux); zeros elsewhere."""
    out = {"rss_mb": 0.0, "threads": 0}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    out["rss_mb"] = int(line.split()[1]) / 1024
                elif line.startswith("Threads:"):
                    out["threads"] = int(line.split()[1])
    except OSError:
        pass
    return out


def parse_metrics(text: str) -> dict:
    """The /metrics gauges the soak reads (summed over labels), and HTTP answers by status."""
    out: dict = {"http_status": Counter()}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        name = name.removeprefix("parallm_")
        if name in GAUGES:
            out[GAUGES[name]] = out.get(GAUGES[name], 0.0) + float(value)
        elif name == "http_requests_total" and 'status="' in labels:
            out["http_status"][labels.split('status="')[1].split('"')[0]] += int(float(value))
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def _slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx_) ** 2 for x in xs)
    return sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


# -- the run -----------------------------------------------------------------------------------

async def _drive(target: _Target, cfg: SoakConfig, progress) -> SoakResult:
    import httpx

    result = SoakResult(config=asdict(cfg))
    limits = httpx.Limits(max_connections=cfg.max_queue * 3, max_keepalive_connections=cfg.workers * 2)
    async with httpx.AsyncClient(base_url=target.base_url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        adapter = target.adapter_dir is not None
        reference = await probe(client, model, adapter)  # minute zero, before any load: what every probe must keep
        traffic = Traffic(client, cfg.seed, cfg.workers, cfg.max_queue, model, adapter)
        load = asyncio.create_task(traffic.run())
        t0 = time.monotonic()
        n_intervals = max(1, round(cfg.minutes * 60 / cfg.interval_s))
        for k in range(n_intervals):
            await asyncio.sleep(max(0.0, t0 + (k + 1) * cfg.interval_s - time.monotonic() - 1.0))
            rejected = await traffic.burst() if k % 2 == 0 else 0
            probes = await probe(client, model, adapter)
            for j, (want, got) in enumerate(zip(reference, probes)):
                if want != got:
                    result.probe_mismatches.append({"interval": k, "probe": j, "want": want, "got": got})
            outcomes, traffic.outcomes = traffic.outcomes, []
            metrics = parse_metrics((await client.get("/metrics")).text)
            row = {"interval": k, "t_min": round((time.monotonic() - t0) / 60, 2), **_proc_status(target.pid),
                   **{key: metrics.get(key, 0.0) for key in GAUGES.values()},
                   "requests": len(outcomes), "burst_429": rejected,
                   "status": dict(Counter(str(o.status) for o in outcomes)),
                   "unexpected": sum(1 for o in outcomes if not o.expected),
                   "answered_kinds": dict(Counter(o.kind for o in outcomes if o.status == 200)),
                   "unexpected_kinds": dict(Counter(f"{o.kind}:{o.status}" for o in outcomes if not o.expected)),
                   "ttft_p50_s": _pct([o.ttft_s for o in outcomes if o.ttft_s is not None], 0.5),
                   "ttft_p99_s": _pct([o.ttft_s for o in outcomes if o.ttft_s is not None], 0.99),
                   "itl_p50_s": _pct([g for o in outcomes for g in o.itl_s], 0.5),
                   "itl_p99_s": _pct([g for o in outcomes for g in o.itl_s], 0.99),
                   "probes_ok": sum(w == g for w, g in zip(reference, probes))}
            result.intervals.append(row)
            if progress:
                progress(row)
        # Stop: every worker's request in flight is cancelled (its connection closed: the server must abort it
        # and free its KV), so the end state below also checks cancellation at scale.
        traffic.stopping = True
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
        result.errors = traffic.errors[-20:]
        result.end_state = await _end_state(client, target, result)
    return result


async def _end_state(client, target: _Target, result: SoakResult) -> dict:
    """After the load: wait for the engine to drain, clear the prefix cache, then read every counter."""
    deadline = time.monotonic() + 120
    metrics = parse_metrics((await client.get("/metrics")).text)
    while metrics.get("in_flight", 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        metrics = parse_metrics((await client.get("/metrics")).text)
    freed = (await client.post("/reset_prefix_cache")).json().get("freed_bytes", 0)
    await asyncio.sleep(1.0)
    metrics = parse_metrics((await client.get("/metrics")).text)
    proc = _proc_status(target.pid)
    warm = result.intervals[0] if result.intervals else proc
    result.warm_rss_mb, result.end_rss_mb = warm["rss_mb"], proc["rss_mb"]
    later = result.intervals[1:] or result.intervals
    result.rss_slope_mb_per_min = _slope([r["t_min"] for r in later], [r["rss_mb"] for r in later])
    problems = [f"{key} = {metrics.get(key, 0.0):g} after the load (want 0)" for key in IDLE_ZERO
                if metrics.get(key, 0.0)]
    # Worker pools (the server's to_thread executor, MLX's) grow to their bound while the load runs; a leak
    # is a thread count still growing after the load (above the most seen under it).
    most = max((r["threads"] for r in result.intervals), default=0)
    if most and proc["threads"] > most:
        problems.append(f"threads {proc['threads']} > {most}, the most seen under load")
    if result.warm_rss_mb and proc["rss_mb"] > result.warm_rss_mb * (1 + result.config["rss_margin"]):
        problems.append(f"RSS {proc['rss_mb']:.0f} MB > warm-up {result.warm_rss_mb:.0f} MB "
                        f"+ {result.config['rss_margin']:.0%}")
    return {"freed_bytes": freed, **proc, **{k: metrics.get(k, 0.0) for k in GAUGES.values()}, "problems": problems}


def run_soak(cfg: SoakConfig, progress=None) -> SoakResult:
    target = _Target(cfg)
    target.start()
    try:
        return asyncio.run(_drive(target, cfg, progress))
    finally:
        target.stop()


# -- report ------------------------------------------------------------------------------------

COLUMNS = [("t_min", "min", "{:.1f}"), ("rss_mb", "RSS MB", "{:.0f}"), ("mlx_active", "MLX act MB", "{:.0f}"),
           ("mlx_cache", "MLX cache MB", "{:.0f}"), ("kv_held", "KV held MB", "{:.1f}"),
           ("prefix_cache", "prefix MB", "{:.1f}"), ("pinned", "pinned MB", "{:.1f}"),
           ("pages_used", "pages", "{:.0f}"), ("in_flight", "in flight", "{:.0f}"), ("requests", "reqs", "{:d}"),
           ("unexpected", "unexp", "{:d}"), ("burst_429", "429s", "{:d}"), ("ttft_p50_s", "TTFT p50", "{:.2f}"),
           ("ttft_p99_s", "TTFT p99", "{:.2f}"), ("itl_p50_s", "ITL p50", "{:.3f}"), ("itl_p99_s", "ITL p99", "{:.3f}"),
           ("preemptions", "preempt", "{:.0f}"), ("evictions", "evict", "{:.0f}"), ("probes_ok", "probes", "{:d}")]
_MB = {"mlx_active", "mlx_cache", "kv_held", "prefix_cache", "pinned"}


def format_lines(result: SoakResult) -> list[str]:
    head = " | ".join(label for _, label, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for row in result.intervals:
        cells = []
        for key, _, fmt in COLUMNS:
            value = row.get(key, 0)
            value = value / 2**20 if key in _MB else value
            cells.append(fmt.format(int(value) if fmt == "{:d}" else value))
        lines.append(" | ".join(cells))
    statuses = Counter()
    for row in result.intervals:
        statuses.update(row["status"])
    unexpected = Counter()
    for row in result.intervals:
        unexpected.update(row.get("unexpected_kinds", {}))
    lines.append(f"answers by status: {dict(sorted(statuses.items()))}; 5xx: {result.server_errors}; "
                 f"probe mismatches: {len(result.probe_mismatches)}; unexpected (kind:status): {dict(unexpected)}")
    lines.append(f"RSS after warm-up {result.warm_rss_mb:.0f} MB, at the end {result.end_rss_mb:.0f} MB, "
                 f"slope {result.rss_slope_mb_per_min:+.2f} MB/min after warm-up")
    problems = result.end_state.get("problems")
    lines.append("end state: clean (no page, pin, request or thread left)" if not problems
                 else "end state: NOT clean: " + "; ".join(problems))
    return lines


def write_plot(result: SoakResult, directory: str) -> str:
    from parallm_bench.plot import check_available

    check_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    t = [r["t_min"] for r in result.intervals]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    axes[0].plot(t, [r["rss_mb"] for r in result.intervals], label="RSS")
    axes[0].plot(t, [r["mlx_active"] / 2**20 for r in result.intervals], label="MLX active")
    axes[0].plot(t, [r["kv_held"] / 2**20 for r in result.intervals], label="KV held")
    axes[0].set_ylabel("MB")
    axes[1].plot(t, [r["ttft_p50_s"] for r in result.intervals], label="TTFT p50")
    axes[1].plot(t, [r["ttft_p99_s"] for r in result.intervals], label="TTFT p99")
    axes[1].plot(t, [r["itl_p99_s"] for r in result.intervals], label="ITL p99")
    axes[1].set_ylabel("s")
    axes[2].plot(t, [r["requests"] for r in result.intervals], label="requests")
    axes[2].plot(t, [r["preemptions"] for r in result.intervals], label="preemptions (total)")
    axes[2].plot(t, [r["evictions"] for r in result.intervals], label="evictions (total)")
    axes[2].set_xlabel("minutes")
    for ax in axes:
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle("parallm soak")
    path = os.path.join(directory, "soak.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def main(args) -> int:
    cfg = SoakConfig(minutes=args.minutes, interval_s=args.interval, seed=args.seed if args.seed is not None else 2026,
                     target=args.soak_target, model=args.model, kv_memory=args.soak_kv_memory)
    print(f"soak: {cfg.minutes:g} min against {'parallm serve' if cfg.target == 'server' else 'the in-process engine'}"
          f" (KV budget {cfg.kv_memory}, queue {cfg.max_queue}, {cfg.workers} client workers, seed {cfg.seed})")
    result = run_soak(cfg, progress=lambda row: print(
        f"  {row['t_min']:.1f} min: RSS {row['rss_mb']:.0f} MB, {row['requests']} requests, "
        f"probes {row['probes_ok']}, status {row['status']}", flush=True))
    for line in format_lines(result):
        print(line)
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(result.as_dict(), fh, indent=2)
        print(f"wrote {args.json_path}")
    if args.plot:
        print(f"wrote {write_plot(result, args.plot)}")
    return 0 if result.clean and not result.server_errors and not result.probe_mismatches else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0, help="soak: how long to drive the server (default 30)")
    p.add_argument("--interval", type=float, default=60.0, help="soak: seconds between records (default 60)")
    p.add_argument("--soak-target", choices=("server", "inproc"), default="server",
                   help="soak: `parallm serve` in its own process (default) or the engine + app in this one")
    p.add_argument("--soak-kv-memory", default="64MiB", help="soak: the server's KV budget (small: preemption)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m parallm_bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--plot", default=None)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
