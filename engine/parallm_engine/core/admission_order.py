"""Which waiting sequence the scheduler admits next: the order of calls by their programs.

At the most urgent waiting priority (explicit ``priority`` always wins), among the first ``WINDOW`` waiting
sequences of that priority:

1. **The bound.** The earliest sequence that has been passed ``MAX_PASSES`` times goes first. A sequence is
   *passed* each time one that arrived after it at its priority is admitted before it; so no call is passed
   more than ``MAX_PASSES`` times: it waits behind at most that many later calls on top of what it would wait
   under FIFO. (Memory can still make it wait: a sequence that does not fit is waited for, never skipped,
   while rows run.)
2. **A returning turn whose context is held.** A session's turn whose own context its pin still holds
   (``kv/session_pins.py``) needs only its new tokens: it goes first where it fits in the room left (else
   its pin holds memory for a turn stuck behind a larger one, and under memory pressure every turn that waits
   lets its pin be displaced and pays its context again).
3. **Fair across groups** (one HTTP request, one caller's batch): the sequence whose group has the fewest
   sequences admitted: a 1,000-prompt batch cannot lock out a 2-prompt call that arrives after it.
4. **First come, by program** (Continuum's program-level FCFS): among equals, the call of the program that
   started first (its first call's arrival; a call naming no program is a program of its own, started when it
   arrived). A running agent's next turn goes ahead of programs that started after it, so the programs under
   way finish instead of all of them advancing together and each finishing late.

Least attained service first (Autellix's PLAS; ``programs.py`` reports each program's) starts every new
program ahead of the runs under way, which under memory pressure keeps them all resident at once; program-level
FCFS is Continuum's choice for exactly that case. What the programs trace measured of both: docs/programs.md.
Where no call names a program or a session, rules 2 and 4 reduce to the queue's order
and admission is FIFO with fair groups, bounded by rule 1.
"""

from __future__ import annotations

#: At most this many later calls go ahead of a waiting call (rule 1).
MAX_PASSES = 8
#: Waiting sequences (at the best priority) considered per admission: bounds the work per step.
WINDOW = 64


def next_to_admit(waiting, groups: dict, room: int, kv, programs):
    """The waiting sequence to admit next (``waiting`` in urgency order, non-empty), and it counts as passed
    every candidate that arrived before it. ``groups``: sequences admitted per group; ``room``: bytes free
    for admission; ``kv``: the KV manager (``holds_kept_context``, ``context_bytes``); ``programs``: the
    :class:`~parallm_engine.core.programs.ProgramTable`."""
    priority = waiting[0].request.priority
    window = []
    for s in waiting:
        if s.request.priority != priority or len(window) == WINDOW:
            break
        window.append(s)
    chosen = next((s for s in window if s.passed >= MAX_PASSES), None)
    if chosen is None:
        chosen = next((s for s in window if kv.holds_kept_context(s) and kv.context_bytes(s) <= room), None)
    if chosen is None:
        chosen = min(window, key=lambda s: (groups.get(s.request.group, 0), _started(s, programs)))
    for s in window:
        if s is chosen:
            break
        s.passed += 1
    return chosen


def _started(seq, programs) -> float:
    """When ``seq``'s program started: its first call's arrival (a call of no program: its own arrival)."""
    t = programs.started(seq.request.program)
    return seq.request.arrival if t is None else t
