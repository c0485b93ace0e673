"""Engine-wide and per-request measurements: TTFT, inter-token latency, throughput, occupancy."""

from __future__ import annotations

import json
import threading
import time
from collections import deque

from parallm_engine import settings
from parallm_engine.core.programs import ProgramTable
from parallm_engine.core.timeline import Timeline


def _percentile(values, q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    k = min(len(v) - 1, max(0, int(round(q * (len(v) - 1)))))
    return v[k]


def step_breakdown_ms(steps: int, plan: float, prefill: float, decode: float, device_wait: float,
                      launch: float = 0.0) -> dict:
    """Mean ms per step: planning, prefill, decode host work (decode minus the device wait), device wait,
    of that the launch (``mx.async_eval``: on a GPU, MLX encoding the step's kernels on this thread, host
    work too; on MLX's CPU backend most of the step's compute), and the share of plan + decode spent on the
    host (what must stay small where a GPU step is short)."""
    n = max(steps, 1)
    host = max(decode - device_wait, 0.0)
    return {"plan": round(1e3 * plan / n, 3), "prefill": round(1e3 * prefill / n, 3),
            "decode_host": round(1e3 * host / n, 3), "device_wait": round(1e3 * device_wait / n, 3),
            "launch": round(1e3 * launch / n, 3),
            "host_share": round((plan + host) / (plan + decode), 3) if plan + decode > 0 else 0.0}


class StepTrace:
    """One JSON line per engine step, to find which steps are slow and why (``PARALLM_STEP_TRACE=<path>``;
    off by default). Each line: start time, milliseconds planning / prefilling / decoding and, within the
    decode, blocked on the device (``wait_ms``; of that inside ``mx.async_eval``: ``launch_ms``); prefill tokens, decode rows, rows joined and retired, and the KV bytes the
    pools relocated during the step (a pool grown by a copy, a shrink)."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # line-buffered: complete lines whenever the engine stops
        self._wait = 0.0
        self._launch = 0.0
        self._moved = 0

    def record(self, plan, out, stats, moved: int) -> None:
        wait, self._wait = stats.device_wait_s - self._wait, stats.device_wait_s
        launch, self._launch = stats.launch_s - self._launch, stats.launch_s
        moved, self._moved = moved - self._moved, moved
        self._file.write(json.dumps({
            "t": round(plan.started, 6), "plan_ms": round(1e3 * plan.plan_s, 3),
            "prefill_ms": round(1e3 * out.prefill_s, 3), "decode_ms": round(1e3 * out.decode_s, 3),
            "wait_ms": round(1e3 * wait, 3), "launch_ms": round(1e3 * launch, 3), "prefill_tokens": out.prefill_tokens,
            "fused_tokens": out.fused_tokens,
            "rows": len(out.decode_rows), "joined": len(out.joined), "finished": len(out.finished),
            "moved_bytes": moved}) + "\n")


def step_trace() -> StepTrace | None:
    path = settings.step_trace()
    return StepTrace(path) if path else None


class EngineStats:
    """Counters updated by the engine thread; read (as a snapshot) from any thread."""

    def __init__(self, window: int = 4096):
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.requests_submitted = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        self.requests_rejected = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefill_tokens = 0  # prompt tokens actually computed (not served from cache)
        self.generated_tokens = 0
        self.decode_steps = 0
        self.prefill_forwards = 0  # forward passes spent on prompts (a batched group counts once per lane)
        self.fused_prefill_tokens = 0  # of prefill_tokens, those computed in a decode forward (kv/fused_step.py)
        self.fused_prefill_chunks = 0  # prefill items (chunks, groups) computed in a decode forward (not in prefill_forwards)
        self.steps = 0
        self.busy_time = 0.0
        self.running = 0
        self.peak_running = 0
        self.in_flight = 0  # submitted and not yet finished (waiting + prefilling + running)
        self.peak_in_flight = 0
        self.kv_bytes = 0
        self.peak_kv_bytes = 0
        self.kv_bytes_held = 0
        self.peak_kv_bytes_held = 0
        self.preemptions = 0  # running sequences whose KV was freed to make room (they resume later)
        self.allocation_failures = 0  # steps that failed to allocate; their sequences were preempted
        # Speculative decoding (speculative.py): verification forwards, drafted and accepted tokens.
        self.spec_steps = 0
        self.spec_proposed_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_draft_kv_bytes = 0  # the draft-model method's KV for its rows (draft_model.py)
        # Where a step's wall time goes (seconds, summed over steps): planning (make room, admit), prefill
        # (host and device together), the decode step, and within it the time blocked on the device for
        # sampled tokens. Decode host work = decode - device wait: what a GPU's short step exposes.
        self.step_plan_s = 0.0
        self.step_prefill_s = 0.0
        self.step_decode_s = 0.0
        self.device_wait_s = 0.0
        self.launch_s = 0.0  # of the device wait, inside mx.async_eval (see step_breakdown_ms)
        self.embeddings_finished = 0  # embedding requests delivered (embedding.py)
        self.embedding_tokens = 0  # ... and the tokens they embedded
        self._occupancy_sum = 0
        self._ttft = deque(maxlen=window)
        self._itl = deque(maxlen=window)
        self._last_token: dict[str, float] = {}
        #: Gauges only the engine thread may read from the live structures (its queues, the prefix tree):
        #: it publishes them between steps (:meth:`publish`) and ``Engine.stats()`` reads this snapshot.
        self.published: dict = {"waiting": 0, "prefilling": 0}
        #: Per program: its calls, tokens and time queued / running / paused, and its attained service, which
        #: admission orders by (``programs.py``, ``admission_order.py``).
        self.programs = ProgramTable()
        self.timeline = Timeline()  # each request's and step's times (Engine.timeline, the trace file, spans)

    # -- hooks called by the scheduler ---------------------------------------------------------
    def on_submit(self, req) -> None:
        with self._lock:
            self.requests_submitted += 1
            self.prompt_tokens += len(req.prompt_ids)
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            self.programs.arrive(req)
        self.timeline.queued(req)

    def on_admit(self, req) -> None:
        """The scheduler admitted ``req``'s first sequence (its queue time ends)."""
        if req.admitted_time is None:
            req.admitted_time = time.monotonic()
            with self._lock:
                self.programs.admit(req, req.admitted_time)

    def on_prompt_done(self, req, cached: int | None) -> None:
        if cached is not None:
            req.usage.cached_tokens = cached
            self.cached_tokens += cached

    def on_first_token(self, req) -> None:
        ttft = req.ttft()
        if ttft is not None:
            self._ttft.append(ttft)
        self.timeline.first_token(req)

    def on_token(self, req, now: float) -> None:
        last = self._last_token.get(req.id)
        if last is not None:
            self._itl.append(now - last)
        self._last_token[req.id] = now

    def on_finish(self, req) -> None:
        with self._lock:
            self.requests_finished += 1
            self.in_flight -= 1
            self.programs.end(req, aborted=False)
        self._last_token.pop(req.id, None)
        self.timeline.finished(req)

    def on_abort(self, req) -> None:
        with self._lock:
            self.requests_aborted += 1
            self.in_flight -= 1
            self.programs.end(req, aborted=True)
        self._last_token.pop(req.id, None)
        self.timeline.finished(req, aborted=True)

    def on_step(self, running: int, kv_bytes: int, kv_bytes_held: int | None = None) -> None:
        self.steps += 1
        self.running = running
        self.peak_running = max(self.peak_running, running)
        self._occupancy_sum += running
        self.kv_bytes = kv_bytes
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv_bytes)
        if kv_bytes_held is not None:  # running batch + prefix cache, each byte once
            self.kv_bytes_held = kv_bytes_held
            self.peak_kv_bytes_held = max(self.peak_kv_bytes_held, kv_bytes_held)

    def on_plan(self, plan):
        """A step's plan, before it runs (its admissions and preemptions); returns it."""
        self.timeline.planned(plan)
        return plan

    def on_step_times(self, plan, out) -> None:
        """A step ran ``plan`` and did ``out`` (``step_plan.StepOutput``)."""
        self.step_plan_s += plan.plan_s
        self.step_prefill_s += out.prefill_s
        self.step_decode_s += out.decode_s
        self.timeline.stepped(out)

    def step_breakdown_ms(self) -> dict:
        """Mean milliseconds per engine step in each part (see ``__init__``)."""
        return step_breakdown_ms(self.steps, self.step_plan_s, self.step_prefill_s, self.step_decode_s,
                                 self.device_wait_s, self.launch_s)

    def publish(self, gauges: dict) -> None:
        """Engine thread, between steps. The dict is replaced whole and never mutated afterwards, so a
        reader on any other thread sees one consistent snapshot."""
        self.published = gauges

    def reset_peaks(self) -> None:
        with self._lock:
            self.peak_running = self.running
            self.peak_in_flight = self.in_flight
            self.peak_kv_bytes = self.kv_bytes
            self.peak_kv_bytes_held = self.kv_bytes_held

    def snapshot(self) -> dict:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        ttft, itl = list(self._ttft), list(self._itl)
        return {
            "uptime_s": elapsed,
            "requests_submitted": self.requests_submitted,
            "requests_finished": self.requests_finished,
            "requests_aborted": self.requests_aborted,
            "requests_rejected": self.requests_rejected,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "running": self.running,
            "peak_running": self.peak_running,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefill_tokens": self.prefill_tokens,
            "generated_tokens": self.generated_tokens,
            "steps": self.steps,
            "decode_steps": self.decode_steps,
            "prefill_forwards": self.prefill_forwards,
            "fused_prefill_tokens": self.fused_prefill_tokens,
            "fused_prefill_chunks": self.fused_prefill_chunks,
            "busy_s": self.busy_time,
            "generation_tps_busy": self.generated_tokens / self.busy_time if self.busy_time else 0.0,
            "mean_batch_occupancy": self._occupancy_sum / self.steps if self.steps else 0.0,
            "kv_bytes": self.kv_bytes,
            "peak_kv_bytes": self.peak_kv_bytes,
            "kv_bytes_held": self.kv_bytes_held,
            "peak_kv_bytes_held": self.peak_kv_bytes_held,
            "preemptions": self.preemptions,
            "allocation_failures": self.allocation_failures,
            "spec_steps": self.spec_steps,
            "spec_proposed_tokens": self.spec_proposed_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_acceptance_rate": (self.spec_accepted_tokens / self.spec_proposed_tokens
                                     if self.spec_proposed_tokens else 0.0),
            "spec_draft_kv_bytes": self.spec_draft_kv_bytes,
            "embeddings_finished": self.embeddings_finished,
            "embedding_tokens": self.embedding_tokens,
            "cache_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "step_ms": self.step_breakdown_ms(),
            "step_totals_s": {"steps": self.steps, "plan": self.step_plan_s, "prefill": self.step_prefill_s,
                              "decode": self.step_decode_s, "device_wait": self.device_wait_s,
                              "launch": self.launch_s},
            "ttft_p50_s": _percentile(ttft, 0.5),
            "ttft_p95_s": _percentile(ttft, 0.95),
            "itl_p50_s": _percentile(itl, 0.5),
            "itl_p95_s": _percentile(itl, 0.95),
            "programs": self.programs_snapshot(),
        }

    def forget_program(self, name: str) -> bool:
        """Drop a closed program's figures (``Engine.close_session``); False if none were kept."""
        with self._lock:
            return self.programs.forget(name)

    def programs_snapshot(self) -> dict:
        with self._lock:
            return self.programs.snapshot()
