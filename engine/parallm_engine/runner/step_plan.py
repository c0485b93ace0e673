"""The step contract between the scheduler and the model runner:
``Scheduler.schedule() -> StepPlan``, ``ModelRunner.execute(plan) -> StepOutput``,
``Scheduler.update(plan, out)``.

A plan is complete and frozen when ``schedule`` returns it: every prefill work item with its sequences
and token counts, in the order they run. Nothing a work item computes is read by the planning of another
item of the same step: a prompt that continues an uncached prefix another prompt of the step is computing
waits for the next step, where the radix tree holds it (in-flight dedup across the step boundary). The
one thing the runner decides is how far it gets: it starts no further prefill item once the plan's
``deadline`` has passed and reports how many ran (``StepOutput.prefill_ran``); ``update`` queues the rest
again.

A plan names its sequences as objects in this process; ``message()`` is the same plan with each sequence
by its key (request id, choice index): small, JSON-serialisable, and ``StepPlan.from_message`` gives the
plan back from it on a process that holds the same sequences (another rank of a distributed engine, which
mirrors the scheduler's sequences and opens the same rows). The pages a step's rows take are the KV cache
manager's and are chosen as the step runs, so they are not in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefillWork:
    """One prefill forward (or none): ``kind`` is "chunk" (``new[i]`` more context tokens of each long
    context ``seqs[i]``: one, or one per prefill stream where the runner has several), "group" (several
    short contexts together, all their uncached tokens) or "cached" (a context the prefix cache holds
    whole: no forward). ``finishes``: the sequences whose context (all but its last token) is prefilled
    once this item has run; they join the decode batch in this step."""

    kind: str
    seqs: tuple
    new: tuple  # context tokens computed per sequence
    fused: bool = False  # computed in the step's decode forward (kv/fused_step.py)
    finishes: tuple = ()

    @property
    def n_tokens(self) -> int:
        return sum(self.new)


def seq_key(seq) -> list:
    """A sequence's name in a plan's message: its request's id and its choice index."""
    return [seq.request.id, seq.index]


@dataclass(frozen=True)
class StepPlan:
    started: float  # perf_counter() when planning began
    plan_s: float = 0.0  # seconds spent making room, admitting and planning the prefill
    admitted: tuple = ()  # sequences moved from waiting to prefilling
    preempted: tuple = ()  # running sequences sent back to waiting
    prefill: tuple = ()  # the step's PrefillWork, in order
    deadline: float | None = None  # perf_counter() after which the runner starts no further prefill item

    def message(self) -> dict:
        """The plan with its sequences by key (``seq_key``): plain lists, numbers and strings."""
        def keys(seqs):
            return [seq_key(s) for s in seqs]

        return {"started": self.started, "plan_s": self.plan_s, "deadline": self.deadline,
                "admitted": keys(self.admitted), "preempted": keys(self.preempted),
                "prefill": [{"kind": w.kind, "seqs": keys(w.seqs), "new": list(w.new), "fused": w.fused,
                             "finishes": keys(w.finishes)} for w in self.prefill]}

    @classmethod
    def from_message(cls, message: dict, sequences: dict) -> StepPlan:
        """The plan ``message`` describes, its sequences looked up in ``sequences`` (``tuple(seq_key(s)) -> s``)."""
        def seqs(keys):
            return tuple(sequences[tuple(k)] for k in keys)

        return cls(started=message["started"], plan_s=message["plan_s"], deadline=message["deadline"],
                   admitted=seqs(message["admitted"]), preempted=seqs(message["preempted"]),
                   prefill=tuple(PrefillWork(kind=w["kind"], seqs=seqs(w["seqs"]), new=tuple(w["new"]),
                                             fused=w["fused"], finishes=seqs(w["finishes"]))
                                 for w in message["prefill"]))


@dataclass
class StepOutput:
    """What executing a plan did and took (``ModelRunner.execute``), for ``Scheduler.update``."""

    prefill_ran: int = 0  # the plan's first prefill items that ran (the rest wait for the next step)
    joined: list = field(default_factory=list)  # sequences whose prefill ended this step (decode rows now)
    decode_rows: list = field(default_factory=list)  # the rows of the step's decode forward
    finished: list = field(default_factory=list)  # rows retired since the last step (they finished)
    plain_rows: int = 0  # rows of an ordinary pipelined decode (not speculative): the speculator's cost model
    prefill_s: float = 0.0
    prefill_tokens: int = 0  # computed in prefill forwards (not the fused item's)
    fused_tokens: int = 0  # the fused work's (PrefillWork.fused), where the decode forward computed it
    decode_s: float = 0.0
