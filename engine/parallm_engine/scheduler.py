"""The continuous-batching scheduler. Runs only on the engine thread.

One ``step()``: make room (preempt the least urgent rows if the running batch would outgrow the KV
budget); admit waiting sequences by the memory they take now; prefill new ones in chunks (prompt
prefixes from the prefix cache; requests that arrive together with the same uncached prefix compute
it once: the first stores it, the next ones hit it); move prefilled sequences into the decode batch;
have the decode runner (``decode_runner``) run one decode step for every running sequence through
the model's own forward, sample and hand the tokens to the output processor (detokenise, stops,
deltas); retire finished sequences, keeping their KV in the prefix cache for the next turn. Memory
(the one KV budget, admission room, the prefix cache's share) is ``kv_manager``'s.

A sequence's context is its prompt plus what it generated so far. Prefill covers every context token
but the last; the last runs in the decode step that samples the next token (as mlx-lm's generate
does), so a prefill never computes logits and every token is sampled from the model's own
``__call__`` (final norm, soft-caps, logit scaling included). A preempted sequence keeps its tokens
and sampler state and is prefilled again later (mostly from the prefix cache): it continues with the
tokens it would have produced.

Two cache layouts (``model_caches``): ``"attention"`` models (full attention in every layer) run on
the engine's own KV (``kv_cache``, ``decode_batch``, radix tree, shared prefix); ``"mixed"`` models
(sliding windows, recurrent state) on mlx-lm's batched caches with whole-state prefix snapshots.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import mlx.core as mx

from . import cpu_kernels, embedding, kv_quant, memory_recovery
from .decode_batch import DecodeBatch
from .decode_runner import DecodeRunner
from .errors import RequestCancelledError
from .kv_manager import KVManager
from .memory_budget import mlx_memory
from .kv_cache import SequenceKV
from .kv_pages import PagedLaneKV
from .model_caches import MixedDecodeBatch, cache_arrays, cache_layout, make_cache
from .output_processor import OutputProcessor
from .prefill_runner import run_prefill_group
from .prefix_sharing import shared_prefix_flags
from .radix_cache import PrefixMatch, RadixCache
from .request import Request
from .sequence import Sequence, shared_context_len
from .snapshot_cache import SnapshotCache
from .speculative import TOKEN_BUDGET, Speculator
from .stats import EngineStats

logger = logging.getLogger("parallm_engine")

NO_SPECULATION_MIXED = ("speculative decoding needs KV that can be rolled back; this model has sliding-window "
                        "or recurrent layers (cache layout 'mixed'), which is not supported yet")


# A match whose last node adds only a few tokens (a fan-out's " Question 1" reaching into the sibling
# " Question 12") stops at the node before: those tokens are prefilled again, and the prefix is one
# node's own arrays, the same for every prompt of the fan-out, so a prefill group reads it once
# (prefill_runner) instead of concatenating a private copy per prompt. At most 7 tokens are recomputed.
SHORT_TAIL_TOKENS = 8


def _without_short_tail(match: PrefixMatch) -> PrefixMatch:
    nodes = match.nodes()
    if len(nodes) > 1 and len(nodes[-1].tokens) < SHORT_TAIL_TOKENS:
        return PrefixMatch(nodes[-2], match.length - len(nodes[-1].tokens))
    return match


@dataclass
class SchedulerConfig:
    max_batch_size: int = 64  # sequences decoding at once
    prefill_chunk: int = 512  # tokens per prefill forward
    prefill_budget: int = 2048  # prefill tokens per step, so decoding keeps moving
    kv_budget_bytes: int = 4 << 30  # running-batch KV: admission and preemption
    radix_budget_bytes: int = 1 << 30  # prefix cache
    enable_prefix_cache: bool = True
    pipeline: bool = True  # overlap host work with the next decode step (see Scheduler._decode)
    decode_lanes: int = 1  # parallel decode lanes (CPU cores; see decode_batch)
    cpu_kernels: bool = False  # faster attention/SwiGLU on MLX's CPU backend (see cpu_kernels)
    watermark_tokens: int = 16  # decode steps of growth every running row must have room for
    # A step's target duration: prefill tokens per step are cut to what fits next to the decode step at
    # the measured prefill rate, so aborts, arrivals and running streams wait at most about this long.
    step_time_target_s: float = 0.25
    min_prefill_tokens: int = 64  # prefill progress every step, however slow the machine
    speculative: object = None  # the engine-wide default SpeculativeConfig (speculative.py), or None
    kv_bits: int | None = None  # KV stored at 8 or 4 bits (kv_quant.py); None: the model's dtype


class Scheduler:
    def __init__(self, model, tokenizer, model_info, config: SchedulerConfig, stats: EngineStats):
        self.model = model
        self.tokenizer = tokenizer
        self.info = model_info
        self.config = config
        self.stats = stats
        model_type = str((getattr(model_info, "config", None) or {}).get("model_type", ""))
        self.layout = cache_layout(model, model_type)
        self.n_layers = len(make_cache(model))  # caches, not layers: some layers (MLP blocks) take none
        self.out = OutputProcessor(tokenizer, stats, model_info.context_window)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.kv_format = kv_quant.format_for_model(config.kv_bits, model, self.n_layers, self.layout)
        self.kv_bytes_per_token = kv_quant.bytes_per_token(model, self.n_layers, self.kv_format) \
            if self.kv_format else model_info.kv_bytes_per_token()
        self.preemptions = 0
        self.allocation_failures = 0  # steps that failed to allocate (memory_recovery.py)
        self.failure_streak = 0  # of those, in a row
        self.kv_budget_configured: int | None = None  # while a failure has lowered the KV budget
        # The engine's attention hook (the shared-prefix cascade on every backend) and, on the CPU, its
        # kernels, bound to this model's own module instances (nothing process-wide).
        hooked = cpu_kernels.install(model, model_info.context_window, kernels=config.cpu_kernels)
        self._cpu_kernels = config.cpu_kernels
        # Build/load the native kernels now, not in the middle of the first decode step.
        self.native_kernels = bool(self._cpu_kernels and cpu_kernels.native_available())
        if self.layout == "attention":
            self.batch = DecodeBatch(self.n_layers, config.decode_lanes, self.kv_format)
            self.radix = RadixCache(config.radix_budget_bytes) if config.enable_prefix_cache else None
            self.snapshots = None
            # Decode rows continuing one cached prefix hold it once (cascade attention): needs the
            # radix tree (where the prefix's one copy comes from), the engine's attention hook, and
            # attention over the cached keys themselves (MLA attends over keys decompressed from its
            # cached latents, with positional scores in the mask: it keeps whole rows).
            mla = bool((getattr(model_info, "config", None) or {}).get("kv_lora_rank"))
            self._share_prefix = bool(self.radix is not None and hooked and not mla)
            # MLA also reads its cached keys outside attention (positional scores): it gets them gathered,
            # and it passes those scores in its mask, which a ragged step's rectangle would replace.
            self.batch.attention_reads_pool = hooked and not mla
        else:
            self.batch = MixedDecodeBatch()
            self.radix = None
            self.snapshots = SnapshotCache(config.radix_budget_bytes) if config.enable_prefix_cache else None
            self._share_prefix = False
        if self.radix is not None:  # the tree's paged entries live in the lanes' pools
            self.radix.page_nbytes = PagedLaneKV.page_bytes(self.kv_bytes_per_token)
            self.radix.cached_pages = self.batch.cached_pages
        self.kv = KVManager(config, self.kv_bytes_per_token, self.batch, self.prefix_cache)
        # Speculative decoding needs KV it can roll back: the engine's own (attention layout) only; and
        # not quantized KV (kv_quant.NO_SPECULATION says why).
        self.no_speculation = None if self.layout == "attention" else NO_SPECULATION_MIXED
        if self.kv_format is not None:
            self.no_speculation = kv_quant.NO_SPECULATION
        # Positions one verify step may compute: on the CPU, what the native linear takes per lane (past it
        # a lane's projections go to BLAS at several times the cost per position).
        with cpu_kernels.solo_lane(config.decode_lanes == 1):  # one lane has the kernels' threads to itself
            native_rows = cpu_kernels.native_linear_rows() if self.native_kernels else 0
        budget = min(TOKEN_BUDGET, native_rows * config.decode_lanes) if native_rows else TOKEN_BUDGET
        self.speculator = Speculator(config.speculative, stats, model_info.context_window, token_budget=budget) \
            if self.no_speculation is None else None
        if self.speculator is not None:  # a draft model's KV for its rows counts with the rows (draft_model.py)
            self.kv.draft_kv_bytes = self.speculator.draft_rows.nbytes
        # Models whose attention scores are (B, KV heads, repeats, L, S) need masks with one more axis.
        self._mask_5d = model_type == "gemma2"
        if self._mask_5d and self.layout == "attention":
            self.batch.set_mask_5d()
        # The forward, sampling and delivery of each decode step (and the pipelined step in flight).
        self.runner = DecodeRunner(model, self.batch, self.out, stats, pipeline=config.pipeline,
                                   speculator=self.speculator, retire=self._retire_rows)
        # Measured, for the step-time bound: prefill tokens per second and the rest of a step's time.
        self._prefill_rate: float | None = None
        self._other_step_s = 0.0

    @property
    def running(self) -> list[Sequence]:
        """The decoding sequences; row i of the batch's logits is ``running[i]``."""
        return self.batch.running

    @property
    def requests(self) -> dict:
        return self.out.requests

    @property
    def prefix_cache(self):
        return self.radix if self.radix is not None else self.snapshots

    # -- bookkeeping ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.runner.in_flight)

    def add(self, request: Request) -> None:
        # Build every sequence first: if one fails (a grammar, a sampler), nothing is registered.
        seqs = [embedding.EmbeddingSequence(request)] if request.embedding is not None else \
            [Sequence(request, i, self.tokenizer, self.eos_ids) for i in range(request.params.n)]
        request.sequences = seqs
        self.out.register(request)
        self._enqueue(seqs)
        self.stats.on_submit(request)

    def _enqueue(self, seqs: list[Sequence]) -> None:
        """Waiting sequences stay in urgency order (priority, then arrival): FIFO at equal priority."""
        for s in seqs:
            if not self.waiting or self.waiting[-1].urgency <= s.urgency:
                self.waiting.append(s)
                continue
            at = next(i for i, w in enumerate(self.waiting) if w.urgency > s.urgency)
            self.waiting.insert(at, s)

    def reject(self, request: Request, error: BaseException) -> None:
        """A request whose sequences could not be built: fail it alone (nothing of it is queued)."""
        self.out.end(request, error)

    def abort(self, request_id: str) -> None:
        req = self.out.requests.get(request_id)
        if req is None:
            return
        for s in [s for s in self.waiting if s.request is req]:
            self.waiting.remove(s)
        for s in [s for s in self.prefilling if s.request is req]:
            self.prefilling.remove(s)
            self._release_prefill(s)
        rows = {id(s) for s in self.running if s.request is req}
        if rows:
            self._drop_rows(rows)
        self.stats.on_abort(req)
        self.stats.running = len(self.running)
        self.stats.kv_bytes = self.batch_kv_bytes()  # an idle engine runs no step to update it
        self.out.end(req, RequestCancelledError(f"request {req.id} was cancelled"))

    def fail_all(self, error: BaseException) -> None:
        for req in list(self.out.requests.values()):
            self.stats.on_abort(req)  # no longer in flight: its queue slot is free again
            self.out.end(req, error)
        for s in list(self.prefilling):
            self._release_prefill(s)
        self.waiting.clear()
        self.prefilling.clear()
        self.runner.clear()
        self.clear_batch()

    def clear_batch(self) -> None:
        """Drop every running row and start the lanes' KV afresh; what the prefix cache held in the old
        pools goes with them (a failed step may have left them half-written)."""
        old = self.batch.clear()
        if self.radix is not None and old:
            self.radix.drop_lanes(old)

    def batch_kv_bytes(self) -> int:
        return self.batch.nbytes()

    def kv_bytes_held(self) -> int:
        """Every KV byte the engine keeps alive, each once: the lanes' page pools (the rows' pages and the
        prefix cache's pages in them), a shared prefix unless it is the prefix cache's own, and the
        prefix cache's own arrays (radix tree) or snapshots."""
        cache = self.prefix_cache
        if self.radix is not None:
            return self.batch.held_nbytes() + self.radix.array_bytes
        return self.batch.held_nbytes() + (cache.total_bytes if cache is not None else 0)

    # -- memory ---------------------------------------------------------------------------------
    def _make_room(self) -> None:
        """The prefix cache gives way to the running rows first (``kv_manager``); then the least urgent
        running sequences are preempted while the rows, grown by the watermark, would still exceed the
        budget (never the last one: a single sequence always runs)."""
        self.kv.fit_cache()
        if len(self.running) <= 1 or not self.kv.rows_over_budget():
            return
        self.runner.flush()  # tokens of the step in flight belong to the rows about to leave
        while len(self.running) > 1 and self.kv.rows_over_budget():
            victim = max(self.running, key=lambda s: s.urgency)
            self._preempt(victim)
            self.kv.fit_cache()

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s KV now and queue it to resume: its tokens stay, its KV goes to the prefix
        cache (so most of the re-prefill is a cache hit), its sampler and detokeniser keep their state."""
        self._cache_row(seq)
        self._drop_rows({id(seq)})
        seq._reset_prefill()
        seq.preemptions += 1
        self.preemptions += 1
        self.stats.preemptions = self.preemptions
        if not self.waiting or seq.urgency <= self.waiting[0].urgency:
            self.waiting.appendleft(seq)  # it resumes first among equals: it arrived earlier
        else:
            self._enqueue([seq])

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> None:
        t0 = time.perf_counter()
        self._make_room()
        if self.layout == "attention":
            self.batch.trim()  # pages the prefix cache gave back
        self._admit()
        self.runner.plain_rows = 0
        plan_s = time.perf_counter() - t0
        with cpu_kernels.enabled(self._cpu_kernels):
            joined, prefill_s, prefilled = self._timed_prefill()
            if joined and self.layout == "mixed":  # attention-layout rows joined as their prefill ended
                self._join(joined)
            t_decode = time.perf_counter()
            if self.running:
                if self.layout == "attention":  # page pools grow only into budget nobody holds
                    self.batch.set_spare(self.kv.spare_bytes(), self.kv_bytes_per_token)
                self.runner.step()
            elif self.runner.in_flight:
                self.runner.flush()
        decode_s = time.perf_counter() - t_decode
        self.stats.on_step_times(plan_s, prefill_s, decode_s)
        other = time.perf_counter() - t0 - prefill_s
        self._other_step_s = other if not self._other_step_s else 0.8 * self._other_step_s + 0.2 * other
        if self.runner.plain_rows and not joined and not prefilled:  # a steady decode step: what it costs
            self.speculator.observe_plain_step(self.runner.plain_rows, other)
        self.stats.on_step(len(self.running), self.batch_kv_bytes(), self.kv_bytes_held())
        memory_recovery.step_succeeded(self)

    def _timed_prefill(self) -> tuple[list[Sequence], float, int]:
        """This step's prefill: the sequences that finished it, its seconds and its prompt tokens."""
        t0 = time.perf_counter()
        before = self.stats.prefill_tokens
        try:
            joined = self._prefill()
        finally:
            if self.radix is not None:
                self.radix.end_reads()
        elapsed = time.perf_counter() - t0
        done = self.stats.prefill_tokens - before
        if done >= 16 and elapsed > 0:
            rate = done / elapsed
            self._prefill_rate = rate if self._prefill_rate is None else 0.7 * self._prefill_rate + 0.3 * rate
        return joined, elapsed, done

    def prefill_token_budget(self) -> int:
        """Prefill tokens this step may spend: what fits in the step-time target next to the rest of
        the step (decode, sampling, delivery) at the measured rate, and at least as long as that rest
        takes; ``prefill_budget`` until measured."""
        if not self.config.step_time_target_s:
            return self.config.prefill_budget
        if self._prefill_rate is None:  # not measured yet: one chunk, then the rate is known
            return min(self.config.prefill_budget, self.config.prefill_chunk)
        fit = int(self._prefill_room_s() * self._prefill_rate)
        return max(self.config.min_prefill_tokens, min(self.config.prefill_budget, fit))

    def _prefill_room_s(self) -> float:
        """Seconds of prefill a step may take: what the step-time target leaves next to the rest of the
        step, and at least as long as that rest (a large batch's decode alone may take the whole target:
        inter-token latency then at most doubles while prompts wait, and they never starve)."""
        return max(self.config.step_time_target_s - self._other_step_s, self._other_step_s)

    def _admit(self) -> None:
        """Admit by what a sequence takes now (its context plus the watermark), not by its max_tokens:
        rows grow as they decode and the least urgent are preempted if memory runs short."""
        active = len(self.running) + len(self.prefilling)
        room = self.kv.admission_room() - sum(self.kv.context_bytes(s) for s in self.prefilling)
        groups: dict = {}
        for s in list(self.running) + list(self.prefilling):
            groups[s.request.group] = groups.get(s.request.group, 0) + 1
        while self.waiting and active < self.config.max_batch_size:
            seq = self._next_fair(groups)
            need = self.kv.context_bytes(seq)
            # Always admit when idle, so one oversized request still runs rather than waiting forever.
            if active and need > room:
                break
            self.waiting.remove(seq)
            self.prefilling.append(seq)
            groups[seq.request.group] = groups.get(seq.request.group, 0) + 1
            active += 1
            room -= need
        self.kv.fit_cache(reserved=sum(self.kv.context_bytes(s) for s in self.prefilling))

    def _next_fair(self, groups: dict) -> Sequence:
        """The next sequence to admit: the most urgent priority first; within it, round-robin over
        groups (one HTTP request, or one caller's batch): the waiting sequence whose group has the
        fewest sequences admitted, the earliest first. A 1,000-prompt request cannot lock out a
        2-prompt one that arrives after it."""
        best_priority = self.waiting[0].request.priority
        best, best_count = None, None
        for s in self.waiting:
            if s.request.priority != best_priority:
                break
            n = groups.get(s.request.group, 0)
            if best is None or n < best_count:
                best, best_count = s, n
                if n == 0:
                    break
        return best

    def _start_prefill(self, seq: Sequence) -> None:
        """Look the context up in the prefix cache and pin what matched until the prefill is done."""
        ids = seq.prefill_ids
        seq.prefix_kv = None
        if seq.embedding:  # embedding rows neither read nor fill the prefix cache (embedding.py says why)
            pass
        elif self.radix is not None:
            seq.match = _without_short_tail(self.radix.match(ids, ns=seq.adapter_key))
            self.radix.pin(seq.match.node)
            seq.cached_tokens = seq.match.length
            seq.prefix_kv = self.radix.gather(seq.match) if seq.match.length else None
        elif self.snapshots is not None:
            snap = self.snapshots.match(ids, ns=seq.adapter_key)
            if snap is not None:
                self.snapshots.pin(snap)
                seq.match = snap
                seq.cached_tokens = len(snap.tokens)
            seq.split = self._shared_boundary(seq, ids)
        seq.pos = seq.cached_tokens
        seq.started = True

    def _shared_boundary(self, seq: Sequence, ids: list[int]) -> int:
        """Mixed layout: the longest prefix ``seq`` shares with another queued prompt, past what is
        cached: the first chunk stops there and snapshots it, so the others restore it instead of
        recomputing it (in-flight dedup, and the next wave's hit)."""
        best = 0
        for other in list(self.waiting) + list(self.prefilling):
            if other is seq or other.embedding:  # embedding rows read no snapshot
                continue
            best = max(best, shared_context_len(seq, other))
        return best if seq.cached_tokens + 8 < best < len(ids) else 0

    def _cached_len(self, seq: Sequence) -> int:
        """Context tokens the radix tree holds for ``seq`` now (a peek: nothing is pinned or counted)."""
        if self.radix is None or seq.embedding:
            return 0
        return self.radix.match(seq.prefill_ids, record=False, ns=seq.adapter_key).length

    def _uncached_overlap(self, seq: Sequence, group: list[Sequence], cached: int) -> bool:
        """Would ``seq`` recompute new tokens another group member is about to compute? Then it waits
        one step and finds them in the radix tree (in-flight dedup of a shared uncached prefix)."""
        if self.radix is None or seq.embedding:
            return False
        return any(shared_context_len(seq, g) > cached + 8 for g in group if not g.embedding)

    def _release_prefill(self, seq: Sequence) -> None:
        self._unpin_match(seq)
        seq.cache = None
        seq.prefix_kv = None

    def _unpin_match(self, seq: Sequence) -> None:
        if seq.match is not None:
            if self.radix is not None:
                self.radix.unpin(seq.match.node)
            elif self.snapshots is not None:
                self.snapshots.unpin(seq.match)
        seq.match = None

    def _prefill(self) -> list[Sequence]:
        """Spend up to ``prefill_budget`` context tokens this step. A context longer than one chunk is
        prefilled alone, chunk by chunk, across steps; shorter ones (attention layout) together in
        forward passes (groups) of at most one chunk of tokens, except those whose uncached prefix a
        group member is computing. Sequences whose context is all cached need no forward."""
        budget = self.prefill_token_budget()
        if len(self.prefilling) > len(self.running):
            # Nothing decoding, or a burst (more prompts waiting for their first token than streams
            # waiting for their next): at least a whole chunk per step. The running streams pay a few
            # long steps; the arrivals' TTFT does not wait behind dozens of short ones.
            budget = max(budget, min(self.config.prefill_chunk, self.config.prefill_budget))
        chunk = min(self.config.prefill_chunk, budget)
        done: list[Sequence] = []
        # The token budget follows the measured rate; the clock also stops the step's prefill once the
        # target has passed (a rate measured on an idle machine may not hold on a busy one).
        deadline = time.perf_counter() + self._prefill_room_s() if self.config.step_time_target_s else None
        while self.prefilling and budget > 0 and (deadline is None or time.perf_counter() < deadline):
            head = self.prefilling[0]
            if not head.started:
                self._start_prefill(head)
            remaining = len(head.prefill_ids) - head.pos
            if remaining == 0 and head.cache is None:
                self.prefilling.popleft()
                self._prompt_done(head, self._cache_from_prefix(head), done)
                continue
            if self.layout == "mixed" or head.cache is not None or remaining > chunk:
                budget -= self._prefill_chunk(head, min(chunk, budget), done)
                continue
            group, used = [head], remaining
            for seq in list(self.prefilling)[1:]:
                if len(group) >= self.config.max_batch_size:
                    break
                if seq.cache is not None:
                    continue
                cached = seq.pos if seq.started else self._cached_len(seq)
                left = len(seq.prefill_ids) - cached
                if left == 0 or used + left > min(chunk, budget):
                    continue
                if not seq.started and self._uncached_overlap(seq, group, cached):
                    continue
                if not seq.started:
                    self._start_prefill(seq)
                group.append(seq)
                used += len(seq.prefill_ids) - seq.pos
            for seq in group:
                self.prefilling.remove(seq)
            self._prefill_group(group, done)
            budget -= used
        return done

    def _cache_from_prefix(self, seq: Sequence) -> list:
        """A sequence's caches before its first forward: the prefix cache's hit, or empty ones."""
        if self.layout == "mixed":
            if seq.match is not None:
                return self.snapshots.restore(seq.match)
            return make_cache(self.model)
        if seq.prefix_kv is not None:
            return [SequenceKV(k, v, self.kv_format) for k, v in seq.prefix_kv]
        return [SequenceKV(fmt=self.kv_format) for _ in range(self.n_layers)]

    def _prefill_chunk(self, seq: Sequence, n_max: int, done: list[Sequence]) -> int:
        """One chunk of one sequence's context through its own caches."""
        if seq.cache is None:
            seq.cache = self._cache_from_prefix(seq)
            seq.prefix_kv = None
        ids = seq.prefill_ids
        end = min(len(ids), seq.pos + n_max)
        if seq.split and seq.pos < seq.split < end:
            end = seq.split
        n = end - seq.pos
        tokens = mx.array(ids[seq.pos : end])[None]
        embedding.prefill_forward(self.model, tokens, self._mask_adapter(seq.cache), [(seq, seq.pos, n)])
        seq.pos = end
        self.stats.prefill_tokens += n
        self.stats.prefill_forwards += 1
        mx.eval(self._cache_state(seq.cache) + embedding.pooled_arrays([seq]))
        if self.snapshots is not None and seq.pos == seq.split:
            self.snapshots.insert(ids[: seq.pos], seq.cache, ns=seq.adapter_key)
        if seq.pos < len(ids):
            return n
        self.prefilling.popleft()
        self._prompt_done(seq, seq.cache, done)
        return n

    def _cache_state(self, caches: list) -> list:
        if self.layout == "mixed":
            return cache_arrays(caches)
        return [a for c in caches for x in (c.keys, c.values) for a in kv_quant.arrays(x)]

    def _mask_adapter(self, caches: list) -> list:
        if self._mask_5d:
            for c in caches:
                c.mask_5d = True
        return caches

    def _prefill_group(self, group: list[Sequence], done: list[Sequence]) -> None:
        """Prefill several short contexts together (``prefill_runner``), then hand each its KV."""
        finished = run_prefill_group(self.model, self.batch, group, self.n_layers, self.stats,
                                     share_prefix=self._share_prefix, mask_5d=self._mask_5d, fmt=self.kv_format)
        self._prompts_done(finished, done)

    def _prompt_done(self, seq: Sequence, cache: list, done: list[Sequence]) -> None:
        self._prompts_done([(seq, cache)], done)

    def _prompts_done(self, finished: list[tuple[Sequence, list]], done: list[Sequence]) -> None:
        """Contexts prefilled (all but their last token): store them in the prefix cache, hand the
        sequences to the decode batch. Attention layout: they join the batch now (one write per layer
        for all of them), each reading the prefix the tree holds in its lane's pool from there (borrowed
        pages) and writing the rest into its own pages, which the tree then holds by reference: a
        prompt's KV is held once, and a prefill later in this step finds it in the tree (in-flight
        dedup). Embedding rows are delivered here and go no further (``embedding.finish_embeddings``)."""
        finished = embedding.finish_embeddings(finished, self.out, self.stats)
        seqs = [seq for seq, _ in finished]
        for seq, cache in finished:
            seq.cache = cache
        if self.layout == "attention":
            if self.radix is not None:
                # The tree keeps the copy that got there first: a sequence's KV is bitwise the tree's
                # for what it read from the tree and what it inserts, unless someone else inserted
                # tokens it also computed (then only the part it read): the tree now, or a sequence
                # before it here (each inserts its whole context).
                for i, seq in enumerate(seqs):
                    ids = seq.prefill_ids
                    held = self.radix.match(ids, record=False, ns=seq.adapter_key).length if ids else 0
                    held = max([held] + [shared_context_len(seq, s) for s in seqs[:i]])
                    seq.tree_tokens = len(ids) if held <= seq.cached_tokens else seq.cached_tokens
            self._join(seqs)
            if self.radix is not None:
                for seq in seqs:
                    if seq.prefill_ids:
                        self.radix.insert(seq.prefill_ids, self.batch.row_segments(seq), ns=seq.adapter_key)
        elif self.snapshots is not None:
            for seq, cache in finished:
                if seq.prefill_ids and seq.cached_tokens < len(seq.prefill_ids):
                    self.snapshots.insert(seq.prefill_ids, cache, ns=seq.adapter_key)
        for seq in seqs:
            seq.consumed = len(seq.prefill_ids)
            if not seq.preemptions:
                self.stats.on_prompt_done(seq.request, seq.cached_tokens if seq.index == 0 else None)
            self._unpin_match(seq)
            seq.prefix_kv = None
            done.append(seq)

    def _join(self, seqs: list[Sequence]) -> None:
        if self.layout == "mixed":
            self.batch.join(seqs, None)
            return
        flags = shared_prefix_flags(self.batch, self.radix, seqs) if self._share_prefix else None
        self.batch.join(seqs, flags, self._lend if self.radix is not None else None)

    def _lend(self, seq: Sequence, lane_kv: PagedLaneKV, start: int):
        """Rows read the prefix they hit from the tree's pages in their lane (RadixCache.lendable_slots)."""
        return self.radix.lendable_slots(seq.match, lane_kv, start)

    # -- retiring -------------------------------------------------------------------------------
    def _cache_row(self, seq: Sequence) -> None:
        """Keep a running sequence's context in the prefix cache for the next turn or its own
        resumption: KV for every token but the last (which may not have run); a mixed model's whole
        state under exactly the tokens it has taken in (a pipelined step may have run one more: the
        state cannot be rewound, so the snapshot says so)."""
        if self.radix is not None:
            ids = seq.prefill_ids[: seq.consumed]  # the tokens its KV holds
            if ids:
                self.radix.insert(ids, self.batch.row_segments(seq), ns=seq.adapter_key)
        elif self.snapshots is not None and seq.consumed:
            self.snapshots.insert((seq.prompt_ids + seq.output_ids)[: seq.consumed], self.batch.row_caches(seq),
                                  ns=seq.adapter_key)

    def _retire_rows(self, rows: set[int]) -> None:
        """Drop the sequences whose ``id()`` is in ``rows``, caching their KV for the next turn."""
        for s in self.running:
            if id(s) in rows:
                self._cache_row(s)
        self._drop_rows(rows)

    def _drop_rows(self, rows: set[int]) -> None:
        """Remove the sequences whose ``id()`` is in ``rows`` from the batch and the step in flight."""
        self.batch.drop(rows)
        if self.speculator is not None:
            self.speculator.drop(rows)
        self.runner.drop(rows)
        if self.radix is not None:  # pages the rows gave up may now be the tree's alone
            self.radix.evict_to_budget()

    # -- introspection (engine thread) ----------------------------------------------------------
    def memory_stats(self) -> dict:
        cache = self.prefix_cache
        return {
            "layout": self.layout,
            **self.kv.stats(),
            "kv_bytes_running": self.batch_kv_bytes(),
            "kv_bytes_prefix_cache": cache.total_bytes if cache is not None else 0,
            "kv_bytes_held": self.kv_bytes_held(),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bits": self.kv_format.bits if self.kv_format else None,
            **(self.batch.page_stats() if self.layout == "attention" else {}),
            "preemptions": self.preemptions,
            **mlx_memory(),
        }
