"""One generated choice of a request as the scheduler tracks it."""

from __future__ import annotations

from parallm_engine.core.detokenizer import IncrementalDetokenizer
from parallm_engine.kv.radix_cache import PrefixMatch
from parallm_engine.sampling.reasoning_budget import reasoning_span
from parallm_engine.sampling.repetition_guard import CycleGuard
from parallm_engine.core.request import Request
from parallm_engine.sampling.sampler import SeqSampler
from parallm_engine.kv.snapshot_cache import Snapshot


class Sequence:
    """One generated choice of a request."""

    embedding = False  # an embedding row (embedding.EmbeddingSequence) is prefilled, never decoded
    reasoning = None  # its reasoning span's tracker (reasoning_budget.py): counts, and closes at a budget
    passed = 0  # waiting, how many later calls were admitted before it (core/admission_order.py)

    def __init__(self, request: Request, index: int, tokenizer, eos_ids: set[int]):
        p = request.params
        self.request = request
        self.index = index
        # The scheduler's token key (radix tree, snapshots): an image request's image positions are keyed
        # by the image's pixel hash (vision.VisionPrompt); the sampler reads the real ids.
        self.prompt_ids = request.vision.key_ids if request.vision is not None else request.prompt_ids
        # The prefix cache's namespace: KV computed under a LoRA adapter is that adapter's alone (lora.py).
        self.adapter_key = request.adapter.key if request.adapter is not None else None
        self.sampler = SeqSampler(p, request.prompt_ids, seed_offset=index)
        self.detok = IncrementalDetokenizer(tokenizer, p.stop, p.include_stop_str_in_output)
        self.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)
        self.output_ids: list[int] = []
        self.logprobs = [] if p.logprobs else None
        self.max_new = p.max_tokens
        self.cycle_guard = CycleGuard() if request.cycle_guard else None
        self.constraint = request.grammar() if request.grammar is not None else None
        self.reasoning = reasoning_span(tokenizer, request.prompt_ids, p.thinking_token_budget)
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.preemptions = 0
        self._reset_prefill()

    def _reset_prefill(self) -> None:
        self.cache = None  # per-layer caches while prefilling
        # Context tokens whose KV this sequence's row (or caches) holds: a prefix-cache hit's (set by
        # kv.match), then the prefill's progress, then one more per decode step once its forward is built
        # (advanced by the runner).
        self.computed = 0
        self.match: PrefixMatch | Snapshot | None = None  # pinned prefix-cache hit during prefill
        self.cached_tokens = 0
        self.tree_tokens = 0  # leading tokens whose KV is bitwise the radix tree's copy
        self.started = False  # looked up in the prefix cache (and pinned) yet?
        self.split = 0  # mixed layout: stop the first chunk here and snapshot (a shared prefix's end)
        self.overtaken = 0  # prompt tokens of short prompts that went ahead of it (prefill_planner._shorts_first)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_ids(self) -> list[int]:
        """The context tokens the prefill covers: all but the last, which the next decode step runs."""
        return (self.prompt_ids + self.output_ids)[:-1]

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def urgency(self) -> tuple:
        """Sort key: smaller runs first and is preempted last (vLLM's convention for priority)."""
        return (self.request.priority, self.request.arrival, self.index)
