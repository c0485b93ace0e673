"""What the engine did, request by request and step by step: the lifecycle recorder behind
``Engine.timeline()``, the trace file (``trace_file.py``), the OpenTelemetry spans (``tracing.py``) and the
timings every call reports (``queue_s`` / ``prefill_s`` / ``decode_s``).

The engine thread feeds it through ``EngineStats``' hooks (submit, first token, finish, abort), the step's
plan (admissions, preemptions) and its output (prefill tokens, decode rows). Each event is a few attribute
writes; memory is bounded by two rings (the last ``max_requests`` requests, the last ``max_steps`` steps).
Another thread reads it as a JSON-able snapshot (:meth:`Timeline.snapshot`): each record is appended whole
and then only has fields set, so a reader sees every record as of some moment of the engine thread.

Times are ``time.monotonic()`` seconds; the snapshot's ``wall_offset`` converts them to Unix time
(``wall = t + wall_offset``).
"""

from __future__ import annotations

import time
from collections import deque

MAX_REQUESTS = 4096
MAX_STEPS = 20000


def program_of(req) -> str | None:
    """The program (agent run) a request belongs to. Requests carry no program yet: their session stands in
    for it (the one place to switch when ``Request.program`` exists)."""
    return getattr(req, "program", None) or req.session


class RequestRecord:
    """One request's lifecycle (monotonic seconds; None: not reached yet)."""

    __slots__ = ("id", "program", "session", "arrival", "admitted", "first_token", "finish", "finish_reason",
                 "prompt_tokens", "cached_tokens", "output_tokens", "preemptions", "aborted", "request")

    def __init__(self, req):
        self.id = req.id
        self.program = program_of(req)
        self.session = req.session
        self.arrival = req.arrival
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.finish: float | None = None
        self.finish_reason: str | None = None
        self.prompt_tokens = len(req.prompt_ids)
        self.cached_tokens = 0
        self.output_tokens = 0
        self.preemptions: list[float] = []
        self.aborted = False
        self.request = req  # while it runs (its live output count); dropped when it ends

    def as_dict(self) -> dict:
        req = self.request
        output = self.output_tokens
        if req is not None:  # still running: what its choices hold now
            output = sum(len(getattr(s, "output_ids", ())) for s in list(req.sequences))
        return {"id": self.id, "program": self.program, "session": self.session, "arrival": self.arrival,
                "admitted": self.admitted, "first_token": self.first_token, "finish": self.finish,
                "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "output_tokens": output,
                "preemptions": list(self.preemptions), "aborted": self.aborted}


class Timeline:
    """The recorder (engine thread writes; any thread reads :meth:`snapshot`)."""

    def __init__(self, max_requests: int = MAX_REQUESTS, max_steps: int = MAX_STEPS):
        self.requests: deque[RequestRecord] = deque(maxlen=max_requests)
        self.steps: deque[tuple] = deque(maxlen=max_steps)  # (t0, t1, prefill_tokens, decode_rows)
        self._live: dict[str, RequestRecord] = {}
        self._step_t0 = 0.0

    # -- the engine thread's hooks ---------------------------------------------------------------------
    def queued(self, req) -> None:
        rec = RequestRecord(req)
        self.requests.append(rec)
        self._live[req.id] = rec

    def planned(self, plan) -> None:
        """A step's plan: its admissions (the first one is the request's) and preemptions, at its start."""
        t0 = self._step_t0 = time.monotonic() - plan.plan_s
        for s in plan.admitted:
            req = s.request
            if req.admitted_time is None:
                req.admitted_time = t0
                rec = self._live.get(req.id)
                if rec is not None:
                    rec.admitted = t0
        for s in plan.preempted:
            self.preempted(s.request, t0)

    def preempted(self, req, t: float) -> None:
        rec = self._live.get(req.id)
        if rec is not None:
            rec.preemptions.append(t)

    def stepped(self, out) -> None:
        """A step's output: it ran from its plan's start until now."""
        self.steps.append((self._step_t0, time.monotonic(), out.prefill_tokens + out.fused_tokens,
                           len(out.decode_rows)))

    def first_token(self, req) -> None:
        rec = self._live.get(req.id)
        if rec is not None:
            rec.first_token = req.first_token_time

    def finished(self, req, aborted: bool = False) -> None:
        rec = self._live.pop(req.id, None)
        if rec is None:
            return
        rec.finish = req.finish_time if req.finish_time is not None and not aborted else time.monotonic()
        rec.aborted = aborted
        seqs = list(req.sequences)
        rec.finish_reason = "abort" if aborted else next(
            (s.finish_reason for s in seqs if getattr(s, "finish_reason", None)), "stop")
        rec.cached_tokens = req.usage.cached_tokens
        rec.output_tokens = req.usage.completion_tokens if not aborted else \
            sum(len(getattr(s, "output_ids", ())) for s in seqs)
        rec.request = None
        span = req.span
        if span is not None:  # its OpenTelemetry spans end with it (tracing.py)
            span.end(rec)

    # -- readers (any thread) --------------------------------------------------------------------------
    def snapshot(self, since: float = 0.0) -> dict:
        """Requests active at or after ``since`` (monotonic seconds) and the steps that ended after it."""
        records = list(self.requests)  # copied at once (the engine thread appends as we read)
        steps = list(self.steps)
        return {
            "now": time.monotonic(),
            "wall_offset": time.time() - time.monotonic(),
            "requests": [r.as_dict() for r in records if r.finish is None or r.finish >= since],
            "steps": [{"t0": t0, "t1": t1, "prefill_tokens": p, "decode_rows": d}
                      for t0, t1, p, d in steps if t1 >= since],
        }


def request_timings(req) -> dict:
    """A request's seconds in each phase: ``queue_s`` (arrival to admission), ``prefill_s`` (admission to its
    first token: the prompt's prefill and the first decode step), ``decode_s`` (first token to the end; a
    preempted request's wait to resume counts here). A phase not reached is 0."""
    end = req.finish_time if req.finish_time is not None else time.monotonic()
    admitted = req.admitted_time if req.admitted_time is not None else end
    first = req.first_token_time if req.first_token_time is not None else end
    return {"queue_s": max(admitted - req.arrival, 0.0), "prefill_s": max(first - admitted, 0.0),
            "decode_s": max(end - first, 0.0)}
