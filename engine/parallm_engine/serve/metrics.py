"""Prometheus text exposition (format 0.0.4) for ``parallm serve``'s ``GET /metrics``.

Two sources: the engine's own counters and gauges (``Engine.stats()``: requests, tokens, batch
occupancy, KV bytes, prefix-cache hit rate) read at scrape time, and histograms the server keeps
itself (time to first token, inter-token latency, end-to-end latency, as clients see them) plus HTTP
request counts. Written by hand: the format is a few lines of text and needs no extra dependency.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import Counter
from typing import Iterable

PREFIX = "parallm"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKENS_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str] | None) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _num(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Histogram:
    """A cumulative-bucket histogram (thread-safe; observed from the server's event loop)."""

    def __init__(self, name: str, help: str, buckets: Iterable[float]):
        self.name, self.help = name, help
        self.bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self.bounds) + 1)  # last: above the largest bound (+Inf only)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    @property
    def count(self) -> int:
        return sum(self._counts)

    def render(self, labels: dict[str, str] | None = None) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        base = dict(labels or {})
        running = 0
        for bound, c in zip(self.bounds, counts):
            running += c
            out.append(f"{self.name}_bucket{_labels({**base, 'le': _num(float(bound))})} {running}")
        running += counts[-1]
        out.append(f"{self.name}_bucket{_labels({**base, 'le': '+Inf'})} {running}")
        out.append(f"{self.name}_sum{_labels(base)} {_num(total)}")
        out.append(f"{self.name}_count{_labels(base)} {running}")
        return out


class ServerMetrics:
    """What the HTTP layer measures itself."""

    def __init__(self) -> None:
        p = PREFIX
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds",
                              "Time from request submission to its first generated token.", TTFT_BUCKETS)
        self.itl = Histogram(f"{p}_inter_token_latency_seconds",
                             "Time between consecutive token deliveries of one choice.", ITL_BUCKETS)
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds",
                             "Time from request submission to its last token.", E2E_BUCKETS)
        self.prompt_tokens = Histogram(f"{p}_request_prompt_tokens", "Prompt tokens per request.",
                                       TOKENS_BUCKETS)
        self.generation_tokens = Histogram(f"{p}_request_generation_tokens", "Generated tokens per request.",
                                           TOKENS_BUCKETS)
        self._http: Counter = Counter()
        self._outcomes: Counter = Counter()
        self._lock = threading.Lock()

    def count_http(self, endpoint: str, method: str, status: int) -> None:
        with self._lock:
            self._http[(endpoint, method, str(status))] += 1

    def count_outcome(self, endpoint: str, outcome: str) -> None:
        """``outcome``: finished | client_disconnected | error | rejected."""
        with self._lock:
            self._outcomes[(endpoint, outcome)] += 1

    def render(self, model: str) -> list[str]:
        p = PREFIX
        out = [f"# HELP {p}_http_requests_total HTTP requests answered, by endpoint, method and status.",
               f"# TYPE {p}_http_requests_total counter"]
        with self._lock:
            http, outcomes = dict(self._http), dict(self._outcomes)
        for (endpoint, method, status), n in sorted(http.items()):
            out.append(f"{p}_http_requests_total"
                       f"{_labels({'endpoint': endpoint, 'method': method, 'status': status})} {n}")
        out += [f"# HELP {p}_generation_requests_total Generation requests by endpoint and outcome.",
                f"# TYPE {p}_generation_requests_total counter"]
        for (endpoint, outcome), n in sorted(outcomes.items()):
            out.append(f"{p}_generation_requests_total"
                       f"{_labels({'model': model, 'endpoint': endpoint, 'outcome': outcome})} {n}")
        labels = {"model": model}
        for h in (self.ttft, self.itl, self.e2e, self.prompt_tokens, self.generation_tokens):
            out += h.render(labels)
        return out


# (stats key, metric suffix, type, help)
_ENGINE_METRICS = (
    ("requests_submitted", "engine_requests_submitted_total", "counter", "Requests accepted by the engine."),
    ("requests_finished", "engine_requests_finished_total", "counter", "Requests that ran to completion."),
    ("requests_aborted", "engine_requests_aborted_total", "counter",
     "Requests aborted (client disconnect, cancellation, timeout)."),
    ("requests_rejected", "engine_requests_rejected_total", "counter", "Requests refused because the queue was full."),
    ("prompt_tokens", "prompt_tokens_total", "counter", "Prompt tokens submitted."),
    ("cached_tokens", "cached_prompt_tokens_total", "counter", "Prompt tokens served from the radix prefix cache."),
    ("prefill_tokens", "prefill_tokens_total", "counter", "Prompt tokens computed (not served from the cache)."),
    ("generated_tokens", "generation_tokens_total", "counter", "Tokens generated."),
    ("steps", "engine_steps_total", "counter", "Engine steps run."),
    ("decode_steps", "engine_decode_steps_total", "counter", "Decode steps run."),
    ("prefill_forwards", "engine_prefill_forwards_total", "counter", "Forward passes spent on prompts."),
    ("busy_s", "engine_busy_seconds_total", "counter", "Seconds the engine thread spent working."),
    ("weight_bytes", "weight_bytes", "gauge", "Bytes of model weights this process holds (a distributed rank: its shard)."),
    ("uptime_s", "engine_uptime_seconds", "gauge", "Seconds since the engine started."),
    ("in_flight", "requests_in_flight", "gauge", "Requests in the engine (waiting, prefilling or decoding)."),
    ("peak_in_flight", "requests_in_flight_peak", "gauge", "Most requests in the engine at once."),
    ("waiting", "requests_waiting", "gauge", "Requests queued, not yet admitted."),
    ("prefilling", "requests_prefilling", "gauge", "Sequences in chunked prefill."),
    ("running", "batch_size", "gauge", "Sequences in the decode batch (batch occupancy) at the last step."),
    ("peak_running", "batch_size_peak", "gauge", "Largest decode batch so far."),
    ("mean_batch_occupancy", "batch_occupancy_mean", "gauge", "Mean decode batch size over all engine steps."),
    ("kv_bytes", "kv_cache_bytes", "gauge", "Bytes of KV cache held by running sequences."),
    ("peak_kv_bytes", "kv_cache_bytes_peak", "gauge", "Most bytes of running KV cache so far."),
    ("kv_bytes_held", "kv_held_bytes", "gauge",
     "Bytes of KV the engine keeps alive, each once: running batch, shared prefix and prefix cache."),
    ("peak_kv_bytes_held", "kv_held_bytes_peak", "gauge", "Most bytes of KV held at once so far."),
    ("preemptions", "preemptions_total", "counter",
     "Running sequences preempted to make room (their KV kept in the prefix cache, resumed later)."),
    ("allocation_failures", "allocation_failures_total", "counter",
     "Steps that failed to allocate memory; their sequences were preempted and resumed."),
    ("cache_hit_rate", "prefix_cache_hit_rate", "gauge", "Fraction of prompt tokens served from the prefix cache."),
    ("spec_steps", "spec_decode_steps_total", "counter", "Decode steps that verified speculative drafts."),
    ("spec_proposed_tokens", "spec_proposed_tokens_total", "counter", "Speculative draft tokens verified."),
    ("spec_accepted_tokens", "spec_accepted_tokens_total", "counter", "Speculative draft tokens accepted."),
    ("spec_acceptance_rate", "spec_acceptance_rate", "gauge", "Accepted / proposed speculative draft tokens."),
    ("spec_draft_kv_bytes", "spec_draft_kv_bytes", "gauge", "Bytes of KV the draft model holds for its rows."),
    ("generation_tps_busy", "generation_tokens_per_busy_second", "gauge",
     "Generated tokens per second of engine busy time."),
    ("ttft_p50_s", "engine_ttft_p50_seconds", "gauge", "Median time to first token (engine, recent window)."),
    ("ttft_p95_s", "engine_ttft_p95_seconds", "gauge", "95th percentile time to first token (engine, recent window)."),
    ("itl_p50_s", "engine_itl_p50_seconds", "gauge", "Median inter-token latency (engine, recent window)."),
    ("itl_p95_s", "engine_itl_p95_seconds", "gauge", "95th percentile inter-token latency (engine, recent window)."),
)

# What Engine.stats()["memory"] carries; the disk tier's (kv/disk_tier.py) and sessions' (kv/session_pins.py)
# keys only where they are on.
_MEMORY_METRICS = (
    ("kv_budget_bytes", "kv_budget_bytes", "gauge",
     "The KV memory budget, shared by running sequences and the prefix cache (which gives way first)."),
    ("prefix_cache_limit_bytes", "prefix_cache_limit_bytes", "gauge",
     "What the running sequences leave the prefix cache now (its cap within the budget, at most)."),
    ("prefix_cache_pinned_bytes", "prefix_cache_pinned_bytes", "gauge",
     "Prefix-cache bytes in use by prefilling or running sequences (not evictable now)."),
    ("kv_pages_used", "kv_pages_used", "gauge", "KV pages (kv_page_tokens tokens each) held by running rows or the prefix cache."),
    ("kv_pages_cached", "kv_pages_cached", "gauge", "KV pages only the prefix cache holds (no running row reads them)."),
    ("kv_pages_free", "kv_pages_free", "gauge", "KV pages the decode lanes' pools hold allocated but unused."),
    ("mlx_active_bytes", "mlx_active_memory_bytes", "gauge", "Memory MLX's allocator has handed out."),
    ("mlx_cache_bytes", "mlx_cache_memory_bytes", "gauge", "Freed memory MLX keeps for reuse (bounded by the engine)."),
    ("mlx_peak_bytes", "mlx_peak_memory_bytes", "gauge", "Most memory MLX has had handed out at once."),
    ("kv_disk_hit_tokens", "kv_disk_hit_tokens_total", "counter", "Prompt tokens read back from disk instead of computed."),
    ("kv_disk_bytes_read", "kv_disk_read_bytes_total", "counter", "KV bytes read from disk."),
    ("kv_disk_read_s", "kv_disk_read_seconds_total", "counter", "Seconds spent reading KV from disk (in the background)."),
    ("kv_disk_bytes_written", "kv_disk_written_bytes_total", "counter", "KV bytes written to disk."),
    ("kv_disk_write_s", "kv_disk_write_seconds_total", "counter", "Seconds spent writing KV to disk (in the background)."),
    ("kv_disk_writes_dropped", "kv_disk_writes_dropped_total", "counter", "Blocks not written: the disk fell behind."),
    ("kv_disk_restores_skipped_slower", "kv_disk_restores_skipped_total", "counter",
     "Reads not done: computing the tokens was measured faster."),
    ("kv_disk_rejected_files", "kv_disk_rejected_files_total", "counter", "Damaged or foreign block files deleted."),
    ("kv_disk_cap_bytes", "kv_disk_cap_bytes", "gauge", "The disk tier's size cap."),
    ("sessions_pinned", "sessions_pinned", "gauge", "Sessions whose context is kept pinned between turns."),
    ("sessions_pinned_bytes", "sessions_pinned_bytes", "gauge", "KV bytes the kept sessions pin (shared nodes once)."),
    ("sessions_displaced", "sessions_displaced_total", "counter",
     "Kept sessions let go early: memory was needed by running or waiting requests."),
    ("sessions_overdue_after_s", "sessions_overdue_after_seconds", "gauge",
     "Age at which a kept session not yet back gives way first (1.5x the longest recent gap between turns)."),
)

_PREFIX_CACHE_METRICS = (
    ("bytes", "prefix_cache_bytes", "gauge", "Bytes of KV held by the radix prefix tree."),
    ("max_bytes", "prefix_cache_max_bytes", "gauge", "Byte budget of the radix prefix tree."),
    ("tokens", "prefix_cache_tokens", "gauge", "Tokens stored in the radix prefix tree."),
    ("nodes", "prefix_cache_nodes", "gauge", "Nodes in the radix prefix tree."),
    ("evictions", "prefix_cache_evictions_total", "counter", "Radix tree nodes evicted (LRU)."),
    ("evicted_tokens", "prefix_cache_evicted_tokens_total", "counter", "Tokens evicted from the radix tree."),
    ("lookup_tokens", "prefix_cache_lookup_tokens_total", "counter", "Prompt tokens looked up in the radix tree."),
    ("hit_tokens", "prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the radix tree."),
)


def _gauge_lines(name: str, kind: str, help: str, value, labels: dict[str, str]) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return []
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name}{_labels(labels)} {_num(value)}"]


def render_engine_stats(stats: dict, model: str) -> list[str]:
    labels = {"model": model}
    out: list[str] = []
    for key, suffix, kind, help in _ENGINE_METRICS:
        out += _gauge_lines(f"{PREFIX}_{suffix}", kind, help, stats.get(key), labels)
    memory = stats.get("memory") or {}
    for key, suffix, kind, help in _MEMORY_METRICS:
        out += _gauge_lines(f"{PREFIX}_{suffix}", kind, help, memory.get(key), labels)
    cache = stats.get("prefix_cache") or {}
    for key, suffix, kind, help in _PREFIX_CACHE_METRICS:
        out += _gauge_lines(f"{PREFIX}_{suffix}", kind, help, cache.get(key), labels)
    out += _program_lines(stats.get("programs") or {}, labels)
    dist = stats.get("distributed")
    if dist:
        out += _distributed_lines(dist, labels)
    return out


#: Programs (agent runs) given their own series on /metrics: the most recently active ones (bounded label
#: cardinality; ``Engine.stats()["programs"]`` has up to 512, core/programs.py).
METRIC_PROGRAMS = 16
_PROGRAM_METRICS = (
    ("job_completion_s", "program_job_completion_seconds", "Seconds from the program's first call to its last end."),
    ("queued_s", "program_queued_seconds", "Seconds the program had a call waiting and none running."),
    ("running_s", "program_running_seconds", "Seconds the program had a call admitted."),
    ("paused_s", "program_paused_seconds", "Seconds the program had nothing in flight (tool calls, its own work)."),
    ("calls", "program_calls", "Calls the program made."),
    ("cached_tokens", "program_cached_tokens", "Prompt tokens of the program's calls read from the cache."),
    ("computed_tokens", "program_computed_tokens", "Prompt tokens of the program's calls computed."),
)


def _program_lines(programs: dict, labels: dict) -> list[str]:
    """How many programs the engine tracks and has in flight; per program (the ``METRIC_PROGRAMS`` most recently
    active) its times and tokens."""
    p = PREFIX
    out = _gauge_lines(f"{p}_programs_tracked", "gauge", "Programs (agent runs) the engine reports.",
                       len(programs), labels)
    out += _gauge_lines(f"{p}_programs_in_flight", "gauge", "Programs with a call queued or running.",
                        sum(1 for v in programs.values() if v.get("in_flight")), labels)
    recent = list(programs.items())[-METRIC_PROGRAMS:]
    for key, suffix, help in _PROGRAM_METRICS:
        rows = [(name, v.get(key)) for name, v in recent if isinstance(v.get(key), (int, float))]
        if rows:
            out += [f"# HELP {p}_{suffix} {help}", f"# TYPE {p}_{suffix} gauge"]
            out += [f"{p}_{suffix}{_labels({**labels, 'program': name})} {_num(value)}" for name, value in rows]
    return out


def _distributed_lines(dist: dict, labels: dict) -> list[str]:
    """A distributed engine's ranks (docs/distributed.md): mode and backend, each rank's memory, and the
    control messages rank 0 sends (one per step)."""
    p = PREFIX
    out = _gauge_lines(f"{p}_distributed_ranks", "gauge", "Ranks the model is split over.", dist.get("size"),
                       {**labels, "mode": str(dist.get("mode")), "backend": str(dist.get("backend")),
                        "sharding": str(dist.get("sharding"))})
    out += _gauge_lines(f"{p}_distributed_control_seconds_total", "counter",
                        "Seconds rank 0 spent sending the steps' plans to the other ranks.", dist.get("control_s"), labels)
    out += _gauge_lines(f"{p}_distributed_control_messages_total", "counter",
                        "Control messages rank 0 sent (one per step).", dist.get("control_messages"), labels)
    comm = dist.get("comm") or {}
    out += _gauge_lines(f"{p}_distributed_step_comm_seconds", "gauge",
                        "Communication of one step: its collectives replayed alone every few steps, mean.",
                        comm.get("comm_s_per_step"), labels)
    out += _gauge_lines(f"{p}_distributed_step_comm_share", "gauge",
                        "The share of a step's forwards that its communication takes (probed steps).",
                        comm.get("comm_share"), labels)
    for key, help in (("weights_bytes", "Weight bytes each rank holds (its shard)."),
                      ("kv_bytes_held", "KV bytes each rank holds (its layers or heads)."),
                      ("mlx_active_bytes", "MLX's active memory on each rank.")):
        rows = [r for r in dist.get("ranks") or [] if isinstance(r.get(key), int)]
        if rows:
            name = f"{p}_distributed_rank_{key}"
            out += [f"# HELP {name} {help}", f"# TYPE {name} gauge"]
            out += [f"{name}{_labels({**labels, 'rank': str(r['rank'])})} {r[key]}" for r in rows]
    return out


def render(engine_stats: dict | None, server: ServerMetrics | None, model: str, healthy: bool = True) -> str:
    """The whole ``/metrics`` page."""
    lines = _gauge_lines(f"{PREFIX}_up", "gauge", "1 while the engine thread is serving.", int(healthy),
                         {"model": model})
    if engine_stats is not None:
        lines += render_engine_stats(engine_stats, model)
    if server is not None:
        lines += server.render(model)
    return "\n".join(lines) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
