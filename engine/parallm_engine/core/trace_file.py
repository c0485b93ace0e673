"""A Chrome / Perfetto trace of what the engine did (``Engine.trace(path)``, ``parallm bench --trace PATH``):
the trace event format's JSON (open it in ui.perfetto.dev or chrome://tracing).

Made from the lifecycle recorder (``timeline.py``) when the trace stops, so recording costs nothing more than
the recorder does. Tracks: the engine's steps ("X" events with their prefill tokens and decode rows, and the
rows per step as a "C" counter), and one process per program (requests without one under "requests") with
a thread per request: its call as a span, with queue / prefill / decode spans inside and its preemptions
as instant events. Times are microseconds since the trace started; ``otherData.wall_start`` is when that was
(Unix seconds). The recorder's rings bound what one trace holds (the last 20,000 steps, 4,096 requests).
"""

from __future__ import annotations

import json
import os
import time

ENGINE_PID = 1
STEP_TID = 1
REQUESTS_PID = 2


def chrome_trace(snapshot: dict, start: float, end: float | None = None) -> dict:
    """A timeline snapshot (``Timeline.snapshot``) as a trace event document, times from ``start``
    (monotonic seconds) to ``end`` (None: the snapshot's time); requests still running end at ``end``."""
    end = snapshot["now"] if end is None else end

    def us(t: float) -> float:
        return round((t - start) * 1e6, 3)

    events: list[dict] = [_meta("process_name", ENGINE_PID, 0, "engine"),
                          _meta("thread_name", ENGINE_PID, STEP_TID, "steps")]
    for s in snapshot["steps"]:
        if s["t0"] < start:
            continue
        name = "prefill+decode" if s["prefill_tokens"] and s["decode_rows"] else \
            "prefill" if s["prefill_tokens"] else "decode"
        args = {"prefill_tokens": s["prefill_tokens"], "decode_rows": s["decode_rows"]}
        events.append({"name": name, "cat": "step", "ph": "X", "ts": us(s["t0"]), "dur": us(s["t1"]) - us(s["t0"]),
                       "pid": ENGINE_PID, "tid": STEP_TID, "args": args})
        events.append({"name": "batch", "ph": "C", "ts": us(s["t0"]), "pid": ENGINE_PID,
                       "args": {"decode_rows": s["decode_rows"], "prefill_tokens": s["prefill_tokens"]}})
    programs: dict = {}
    for tid, r in enumerate(snapshot["requests"], start=1):
        if r["arrival"] > end or (r["finish"] is not None and r["finish"] < start):
            continue
        program = r["program"]
        if program not in programs:
            programs[program] = REQUESTS_PID + len(programs)
            events.append(_meta("process_name", programs[program], 0,
                                "requests" if program is None else f"program {program}"))
        pid = programs[program]
        events.append(_meta("thread_name", pid, tid, r["id"]))
        events += _request_events(r, pid, tid, max(r["arrival"], start), end, us)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"wall_start": start + snapshot["wall_offset"], "source": "parallm"}}


def _request_events(r: dict, pid: int, tid: int, begin: float, end: float, us) -> list[dict]:
    finish = r["finish"] if r["finish"] is not None else end
    args = {k: r[k] for k in ("prompt_tokens", "cached_tokens", "output_tokens", "finish_reason", "aborted")}
    args["computed_tokens"] = max(r["prompt_tokens"] - r["cached_tokens"], 0)
    out = [{"name": f"request {r['id']}", "cat": "request", "ph": "X", "ts": us(begin),
            "dur": us(finish) - us(begin), "pid": pid, "tid": tid, "args": args}]
    admitted = r["admitted"] if r["admitted"] is not None else finish
    first = r["first_token"] if r["first_token"] is not None else finish
    for name, t0, t1 in (("queue", r["arrival"], admitted), ("prefill", admitted, first),
                         ("decode", first, finish)):
        t0 = max(t0, begin)
        if t1 > t0:
            out.append({"name": name, "cat": "phase", "ph": "X", "ts": us(t0), "dur": us(t1) - us(t0),
                        "pid": pid, "tid": tid})
    for t in r["preemptions"]:
        out.append({"name": "preempted", "cat": "request", "ph": "i", "s": "t", "ts": us(t), "pid": pid, "tid": tid})
    return out


def _meta(name: str, pid: int, tid: int, value: str) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {"name": value}}


class TraceRecording:
    """A trace being recorded into ``path`` (``Engine.trace``): a context manager, or ``stop()`` it."""

    def __init__(self, timeline, path: str | os.PathLike):
        self._timeline = timeline
        self.path = os.fspath(path)
        self.start = time.monotonic()
        self.stopped = False

    def stop(self) -> str:
        """Write the trace of what happened since the start; returns its path (once: later calls only return it)."""
        if not self.stopped:
            self.stopped = True
            end = time.monotonic()
            doc = chrome_trace(self._timeline.snapshot(self.start), self.start, end)
            with open(self.path, "w") as fh:
                json.dump(doc, fh)
        return self.path

    def __enter__(self) -> TraceRecording:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
