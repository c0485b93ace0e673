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


@dataclass(frozen=True)
class StepPlan:
    started: float  # perf_counter() when planning began
    plan_s: float = 0.0  # seconds spent making room, admitting and planning the prefill
    admitted: tuple = ()  # sequences moved from waiting to prefilling
    preempted: tuple = ()  # running sequences sent back to waiting
    prefill: tuple = ()  # the step's PrefillWork, in order
    deadline: float | None = None  # perf_counter() after which the runner starts no further prefill item


@dataclass
class StepOutput:
    """What executing a plan did and took (``ModelRunner.execute``), for ``Scheduler.update``."""

    prefill_ran: int = 0  # the plan's first prefill items that ran (the rest wait for the next step)
    joined: list = field(default_factory=list)  # sequences whose prefill ended this step (decode rows now)
    decode_rows: list = field(default_factory=list)  # the rows of the step's decode forward
    plain_rows: int = 0  # rows of an ordinary pipelined decode (not speculative): the speculator's cost model
    prefill_s: float = 0.0
    prefill_tokens: int = 0  # computed in prefill forwards (not the fused item's)
    fused_tokens: int = 0  # the fused work's (PrefillWork.fused), where the decode forward computed it
    decode_s: float = 0.0
