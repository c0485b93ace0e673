"""The scheduler's plan for one engine step, which the model runner (``model_runner``) executes, and what
the runner reports back (:class:`StepOutput`): ``Scheduler.schedule() -> StepPlan``,
``ModelRunner.execute(plan) -> StepOutput``, ``Scheduler.update(plan, out)``. The runner writes nothing into
the plan but the prefill items' ``finished`` (the item-by-item hand-over below).

``prefill`` is handed out lazily: the scheduler plans each work item once the one before it has run,
because what comes next depends on it (the step's prefill stops on the clock, and a prompt whose
uncached prefix another prompt of the step is computing waits for it to reach the radix tree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class PrefillWork:
    """One prefill forward (or none): ``kind`` is "chunk" (``new[i]`` more context tokens of each long
    context ``seqs[i]``: one, or one per prefill stream where the runner has several), "group" (several
    short contexts together, all their uncached tokens) or "cached" (a context the prefix cache holds
    whole: no forward); ``n_tokens`` in all. The runner fills ``finished``: the ``(sequence, its caches)``
    whose context is now prefilled."""

    kind: str
    seqs: list
    n_tokens: int
    new: list = field(default_factory=list)  # a chunk's tokens per sequence
    fused: bool = False  # computed in the step's decode forward (kv/fused_step.py)
    finished: list = field(default_factory=list)


@dataclass
class StepPlan:
    started: float  # perf_counter() when planning began
    plan_s: float = 0.0  # seconds spent making room and admitting
    admitted: list = field(default_factory=list)  # sequences moved from waiting to prefilling
    preempted: list = field(default_factory=list)  # running sequences sent back to waiting
    prefill: Iterator[PrefillWork] = field(default_factory=lambda: iter(()))  # planned as the runner draws them
    joined: list = field(default_factory=list)  # sequences whose prefill ended this step (decode rows next)
    finished: list = field(default_factory=list)  # sequences retired this step (their KV cached)


@dataclass
class StepOutput:
    """What executing a plan did and took (``ModelRunner.execute``), for ``Scheduler.update``."""

    decode_rows: list = field(default_factory=list)  # the rows of the step's decode forward
    plain_rows: int = 0  # rows of an ordinary pipelined decode (not speculative): the speculator's cost model
    prefill_s: float = 0.0
    prefill_tokens: int = 0  # computed in prefill forwards (not the fused item's)
    fused_tokens: int = 0  # the fused work's (PrefillWork.fused), where the decode forward computed it
    decode_s: float = 0.0
