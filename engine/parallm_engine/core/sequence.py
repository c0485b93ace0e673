"""One generated choice of a request as the scheduler tracks it, and small helpers on token lists."""

from __future__ import annotations

import mlx.core as mx

from parallm_engine.core.detokenizer import IncrementalDetokenizer
from parallm_engine.kv.radix_cache import PrefixMatch
from parallm_engine.sampling.repetition_guard import CycleGuard
from parallm_engine.core.request import Request
from parallm_engine.sampling.sampler import SeqSampler
from parallm_engine.kv.snapshot_cache import Snapshot


class Sequence:
    """One generated choice of a request."""

    embedding = False  # an embedding row (embedding.EmbeddingSequence) is prefilled, never decoded

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
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.preemptions = 0
        self._reset_prefill()

    def _reset_prefill(self) -> None:
        self.cache = None  # per-layer caches while prefilling
        self.pos = 0  # context tokens prefilled so far
        self.match: PrefixMatch | Snapshot | None = None  # pinned prefix-cache hit during prefill
        self.cached_tokens = 0
        self.tree_tokens = 0  # leading tokens whose KV is bitwise the radix tree's copy
        self.started = False  # looked up in the prefix cache (and pinned) yet?
        self.split = 0  # mixed layout: stop the first chunk here and snapshot (a shared prefix's end)
        self.consumed = 0  # context tokens the sequence's caches have taken in (the forwards built)
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


def common_prefix_len(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Leading elements ``a`` and ``b`` share (at most ``limit``). Halved by slice compares, which run in C:
    the planner asks this for prompts sharing thousands of tokens (an agents' system prompt) every step."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    lo, hi = 0, n  # a[:lo] == b[:lo]; the first difference (or n) is in [lo, hi]
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


def shared_context_len(a: Sequence, b: Sequence) -> int:
    """Leading context tokens whose KV ``a`` and ``b`` compute alike: their common prefix under one adapter."""
    return common_prefix_len(a.prefill_ids, b.prefill_ids) if a.adapter_key == b.adapter_key else 0


def next_inputs(running: list[Sequence], prev_seqs: list[Sequence], prev_toks: mx.array) -> mx.array:
    """The next decode step's input tokens in ``running``'s row order: the pipelined step's tokens
    (still being computed) for the sequences it covered, the last context token for those that
    joined since."""
    pos = {id(s): i for i, s in enumerate(prev_seqs)}
    joined = [s for s in running if id(s) not in pos]
    if not joined and len(prev_seqs) == len(running) and all(a is b for a, b in zip(prev_seqs, running)):
        return prev_toks
    n = len(prev_seqs)
    extra = {id(s): n + j for j, s in enumerate(joined)}
    order = mx.array([pos[id(s)] if id(s) in pos else extra[id(s)] for s in running])
    pool = mx.concatenate([prev_toks, mx.array([s.last_token for s in joined], dtype=prev_toks.dtype)]) \
        if joined else prev_toks
    return pool[order]
