"""Programs: the agent runs the engine's calls belong to, and what each has been served.

An agent run is a program of many model calls separated by tool pauses (a LangGraph run, a LlamaIndex
workflow, a DSPy module call, a coding agent's session on the server). A request names its program
(``Engine.submit(..., program=)``; by default its ``session``, the conversation it is a turn of); a request
that names neither is a program of its own, which is how the engine behaved before programs.

The table records, per program: its calls, their tokens (cached, computed, generated) and where its wall
time went: *queued* (a call waits and none runs), *running* (at least one call is admitted), *paused*
(nothing in flight: a tool call, the agent's own work). The state changes only at a call's arrival, admission
and end, so the buckets are exact: each event adds the time since the last one to the bucket of the state
before it. A program's job completion time is its last call's end minus its first call's arrival.

Admission orders calls by when their program started (``admission_order.py``). The table also reports each
program's attained service (Autellix's PLAS): the tokens its ended calls cost the engine (prompt tokens
computed plus tokens generated).

Bounded: the table keeps at most ``MAX_PROGRAMS`` programs, dropping the one idle longest (never one with a
call in flight). Engine thread only, except :meth:`snapshot` (under the stats lock).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

#: Programs the table keeps (the idle longest go first): bounds memory and ``/metrics`` label cardinality.
MAX_PROGRAMS = 512


@dataclass
class ProgramRecord:
    name: str
    first_arrival: float
    last_event: float
    last_finish: float | None = None
    calls: int = 0
    calls_finished: int = 0
    calls_aborted: int = 0
    queued: int = 0  # calls waiting now
    running: int = 0  # calls admitted and not ended
    queued_s: float = 0.0
    running_s: float = 0.0
    paused_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    service: int = 0  # attained service: tokens its ended calls computed (prompt not cached + generated)

    def _advance(self, now: float) -> None:
        """Charge the time since the last event to the state the program was in."""
        dt = max(0.0, now - self.last_event)
        if self.running:
            self.running_s += dt
        elif self.queued:
            self.queued_s += dt
        else:
            self.paused_s += dt
        self.last_event = now

    def as_dict(self) -> dict:
        end = self.last_finish if self.last_finish is not None else self.last_event
        return {
            "calls": self.calls, "calls_finished": self.calls_finished, "calls_aborted": self.calls_aborted,
            "in_flight": self.queued + self.running,
            "job_completion_s": round(max(0.0, end - self.first_arrival), 6),
            "queued_s": round(self.queued_s, 6), "running_s": round(self.running_s, 6),
            "paused_s": round(self.paused_s, 6),
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "computed_tokens": self.prompt_tokens - self.cached_tokens,
            "generated_tokens": self.generated_tokens, "attained_service": self.service,
        }


class ProgramTable:
    def __init__(self, max_programs: int = MAX_PROGRAMS):
        self.max_programs = max_programs
        self.records: OrderedDict[str, ProgramRecord] = OrderedDict()

    def started(self, program: str | None) -> float | None:
        """When the program's first call arrived (None for a program not seen, or none)."""
        rec = self.records.get(program) if program is not None else None
        return rec.first_arrival if rec is not None else None

    def arrive(self, req, now: float | None = None) -> None:
        if req.program is None:
            return
        now = time.monotonic() if now is None else now
        rec = self.records.get(req.program)
        if rec is None:
            rec = self.records[req.program] = ProgramRecord(req.program, first_arrival=now, last_event=now)
            self._bound()
        else:
            rec._advance(now)
            self.records.move_to_end(req.program)
        rec.calls += 1
        rec.queued += 1
        rec.prompt_tokens += len(req.prompt_ids)

    def admit(self, req, now: float | None = None) -> None:
        """A call's first admission (a preempted call's re-admission is not a new one)."""
        rec = self.records.get(req.program) if req.program is not None else None
        if rec is None or rec.queued <= 0:
            return
        rec._advance(time.monotonic() if now is None else now)
        rec.queued -= 1
        rec.running += 1

    def end(self, req, aborted: bool, now: float | None = None) -> None:
        rec = self.records.get(req.program) if req.program is not None else None
        if rec is None:
            return
        now = time.monotonic() if now is None else now
        rec._advance(now)
        if req.admitted_time is not None and rec.running > 0:
            rec.running -= 1
        elif rec.queued > 0:
            rec.queued -= 1
        rec.last_finish = now
        cached = req.usage.cached_tokens or 0
        rec.cached_tokens += cached
        rec.generated_tokens += req.usage.completion_tokens
        rec.service += len(req.prompt_ids) - cached + req.usage.completion_tokens
        if aborted:
            rec.calls_aborted += 1
        else:
            rec.calls_finished += 1

    def forget(self, program: str) -> bool:
        """Drop ``program``'s record (its run is closed); False if it had none."""
        return self.records.pop(program, None) is not None

    def _bound(self) -> None:
        while len(self.records) > self.max_programs:
            idle = next((name for name, r in self.records.items() if not (r.queued or r.running)), None)
            if idle is None:
                return
            del self.records[idle]

    def snapshot(self, now: float | None = None) -> dict:
        """Per program (the most recently active last), with its current state's time charged up to ``now``."""
        now = time.monotonic() if now is None else now
        out = {}
        for name, rec in list(self.records.items()):
            d = rec.as_dict()
            key = "running_s" if rec.running else "queued_s" if rec.queued else None
            if key is not None:  # the state it is in now, charged up to now (paused time ends at the next call)
                d[key] = round(d[key] + max(0.0, now - rec.last_event), 6)
                d["job_completion_s"] = round(max(0.0, now - rec.first_arrival), 6)
            out[name] = d
        return out
