"""The continuous-batching scheduler: it plans each step; it runs no forward and holds no KV. Runs only
on the engine thread.

One ``step()``: ``schedule()`` makes room (preempts the least urgent rows if the running batch would
outgrow the KV budget), admits waiting sequences by the memory they take now and plans the step's prefill
work (a long context alone, chunk by chunk; short ones in groups; prompts that arrive together with the
same uncached prefix compute it once: one this step, the others from the radix tree the next), and returns
the step's plan, complete and frozen (``step_plan.StepPlan``); the model runner's ``execute(plan)``
(``model_runner``) runs it and one decode step for every running row, and returns what it ran and took
(``step_plan.StepOutput``); ``update(plan, out)`` does the bookkeeping. Every KV hand-off (prefix match and
pins, a prompt's caches, commits to the prefix cache, joins, frees) and the one KV budget are the KV cache
manager's (``kv_cache_manager``).

A sequence's context is its prompt plus what it generated so far. Prefill covers every context token
but the last; the last runs in the decode step that samples the next token (as mlx-lm's generate
does). A preempted sequence keeps its tokens and sampler state and is prefilled again later (mostly
from the prefix cache): it continues with the tokens it would have produced.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from parallm_engine import settings
from parallm_engine.embed import embedding

from parallm_engine.core import memory_recovery
from parallm_engine.errors import RequestCancelledError
from parallm_engine.runner.family_adapters import adapter_for
from parallm_engine.kv.kv_layouts import make_kv_cache_manager
from parallm_engine.kv.session_pins import DEFAULT_SHARE, kept_turn_that_fits
from parallm_engine.kv.memory_budget import mlx_memory
from parallm_engine.runner.model_runner import ModelRunner
from parallm_engine.core.output_processor import OutputProcessor
from parallm_engine.core.prefill_planner import PrefillPlanner
from parallm_engine.core.request import Request
from parallm_engine.core.sequence import Sequence
from parallm_engine.core.stats import EngineStats, step_trace
from parallm_engine.runner.step_plan import StepOutput, StepPlan


@dataclass
class SchedulerConfig:
    max_batch_size: int = 64  # sequences decoding at once
    prefill_chunk: int = 512  # tokens per prefill forward
    prefill_budget: int = 2048  # prefill tokens per step, so decoding keeps moving
    kv_budget_bytes: int = 4 << 30  # running-batch KV: admission and preemption
    radix_budget_bytes: int = 1 << 30  # prefix cache
    working_set_bytes: int | None = None  # kept decode working sets (memory_budget.working_set_bytes)
    enable_prefix_cache: bool = True
    pipeline: bool = True  # overlap host work with the next decode step (see decode_runner)
    decode_lanes: int = 1  # parallel decode lanes (CPU cores; see decode_batch)
    # The lanes are a distributed pipeline's micro-batches (runner/forward.micro_batched): rows spread evenly,
    # every lane on the default stream, a step's lane forwards evaluated stage first.
    micro_batches: bool = False
    cpu_kernels: bool = False  # faster attention/SwiGLU on MLX's CPU backend (see cpu_kernels)
    batch_invariant: bool = False  # pad the CPU BLAS's small products so rows are batch-invariant (batch_invariance)
    watermark_tokens: int = 16  # decode steps of growth every running row must have room for
    # A step's target duration: a long prompt's prefill tokens per step are cut to what fits next to the
    # decode step at the measured prefill rate, so aborts, arrivals and running streams wait at most about
    # this long (a short prompt, a chunk at most, and a burst take a whole chunk: prefill_planner.py).
    step_time_target_s: float = 0.25
    min_prefill_tokens: int = 64  # prefill progress every step, however slow the machine
    speculative: object = None  # the engine-wide default SpeculativeConfig (speculative.py), or None
    kv_bits: int | None = None  # KV stored at 8 or 4 bits (kv_quant.py); None: the model's dtype
    # A long prompt's chunk computed in the decode forward where it can be (kv/fused_step.py).
    fuse_prefill: bool = field(default_factory=settings.fuse_prefill)
    # A plain decode step of unchanged rows as one compiled graph (runner/compiled_decode.py; experimental).
    compile_decode: bool = field(default_factory=settings.compile_decode)
    # Lanes keep their decode working sets between plain steps (kv/decode_working_set.py).
    decode_working_set: bool = field(default_factory=settings.decode_working_set)
    kv_disk: object = None  # the prefix cache's disk tier (kv/disk_tier.DiskTierConfig), or None: off
    # A session's context stays pinned this long after its turn; 0 (the default): sessions off, until they
    # pay on the agents trace (docs/memory.md, "Sessions").
    session_ttl_s: float = 0.0
    session_share: float = DEFAULT_SHARE  # of the KV budget, the most sessions may pin
    kv_events: object = None  # block events for outside routers (kv/kv_events.KVEventsConfig), or None: off


class Scheduler(PrefillPlanner):
    def __init__(self, model, tokenizer, model_info, config: SchedulerConfig, stats: EngineStats):
        self.tokenizer = tokenizer
        self.info = model_info
        self.config = config
        self.stats = stats
        self.out = OutputProcessor(tokenizer, stats, model_info.context_window)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.preemptions = 0
        self.allocation_failures = 0  # steps that failed to allocate (memory_recovery.py)
        self.failure_streak = 0  # of those, in a row
        self.kv_budget_configured: int | None = None  # while a failure has lowered the KV budget
        family = adapter_for(model_info)
        self.kv = make_kv_cache_manager(model, model_info, config, family)
        # The forwards, sampling and delivery of each step (and the pipelined decode step in flight).
        self.runner = ModelRunner(model, model_info, config, stats, self.kv, self.out, family)
        # Measured, for the step-time bound: prefill tokens per second and the rest of a step's time.
        self._prefill_rate: float | None = None
        self._other_step_s = 0.0
        self._trace = step_trace()  # a JSON line per step where PARALLM_STEP_TRACE names a file

    # Views of the parts this scheduler plans for (tests, benchmarks and the engine read them here).
    running = property(lambda self: self.kv.running, doc="The decoding sequences (row i of the logits).")
    requests = property(lambda self: self.out.requests)
    batch = property(lambda self: self.kv.batch)
    radix = property(lambda self: self.kv.radix)
    prefix_cache = property(lambda self: self.kv.prefix_cache)
    layout = property(lambda self: self.kv.layout)
    n_layers = property(lambda self: self.kv.n_layers)
    kv_format = property(lambda self: self.kv.kv_format)
    kv_bytes_per_token = property(lambda self: self.kv.kv_bytes_per_token)
    speculator = property(lambda self: self.runner.speculator)
    no_speculation = property(lambda self: self.runner.no_speculation)
    native_kernels = property(lambda self: self.runner.native_kernels)
    model = property(lambda self: self.runner.model, lambda self, m: setattr(self.runner, "model", m))
    _share_prefix = property(lambda self: self.kv.share_prefix, lambda self, v: setattr(self.kv, "share_prefix", v))

    # -- bookkeeping ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.runner.in_flight)

    def add(self, request: Request) -> None:
        # Build every sequence first: if one fails (a grammar, a sampler), nothing is registered.
        seqs = [embedding.EmbeddingSequence(request)] if request.embedding is not None else \
            [Sequence(request, i, self.tokenizer, self.eos_ids) for i in range(request.params.n)]
        request.sequences = seqs
        self.out.register(request)
        for s in seqs:  # a lower tier's blocks of its prefix are read while it waits (kv/disk_tier.py)
            self.kv.prefetch(s, self._prefill_rate)
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
            self.kv.release(s)
        rows = {id(s) for s in self.running if s.request is req}
        if rows:
            self.runner.drop_rows(rows)
        self.stats.on_abort(req)
        self.stats.running = len(self.running)
        self.stats.kv_bytes = self.batch_kv_bytes()  # an idle engine runs no step to update it
        self.out.end(req, RequestCancelledError(f"request {req.id} was cancelled"))

    def fail_all(self, error: BaseException) -> None:
        for req in list(self.out.requests.values()):
            self.stats.on_abort(req)  # no longer in flight: its queue slot is free again
            self.out.end(req, error)
        for s in list(self.prefilling):
            self.kv.release(s)
        self.waiting.clear()
        self.prefilling.clear()
        self.runner.clear()
        self.kv.clear()

    def batch_kv_bytes(self) -> int:
        return self.kv.running_bytes()

    def kv_bytes_held(self) -> int:
        return self.kv.held_bytes()

    # -- memory ---------------------------------------------------------------------------------
    def _make_room(self, preempted: list) -> None:
        """The prefix cache gives way to the running rows first (``memory_budget.KVBudget``), what sessions keep
        pinned next where that is enough (``kv/session_pins.py``); then the least urgent
        running sequences are preempted while the rows, grown by the watermark, would still exceed the
        budget (never the last one: a single sequence always runs)."""
        self.kv.fit_cache()
        self.kv.yield_sessions_to_rows()  # sessions give way before rows, where that spares them all
        if len(self.running) <= 1 or not self.kv.rows_over_budget():
            return
        self.runner.flush()  # tokens of the step in flight belong to the rows about to leave
        while len(self.running) > 1 and self.kv.rows_over_budget():
            victim = max(self.running, key=lambda s: s.urgency)
            self._preempt(victim)
            preempted.append(victim)
            self.kv.fit_cache()

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s KV now and queue it to resume: its tokens stay, its KV goes to the prefix
        cache (so most of the re-prefill is a cache hit), its sampler and detokeniser keep their state."""
        self.kv.commit_row(seq)
        self.runner.drop_rows({id(seq)})
        seq._reset_prefill()
        seq.preemptions += 1
        self.preemptions += 1
        self.stats.preemptions = self.preemptions
        if not self.waiting or seq.urgency <= self.waiting[0].urgency:
            self.waiting.appendleft(seq)  # it resumes first among equals: it arrived earlier
        else:
            self._enqueue([seq])

    # -- the step -------------------------------------------------------------------------------
    def step(self, on_plan=None) -> None:
        """One engine step (the engine thread's loop calls it): plan, execute, update. ``on_plan(plan)``
        runs between planning and executing (a distributed engine's ranks agree on the plan there)."""
        plan = self.stats.on_plan(self.schedule())  # the timeline sees admissions and preemptions
        if on_plan is not None:
            on_plan(plan)
        self.update(plan, self.runner.execute(plan))

    def schedule(self) -> StepPlan:
        """This step's plan, complete and frozen: room made, sequences admitted, the prefill work."""
        started = time.perf_counter()
        preempted: list[Sequence] = []
        admitted: list[Sequence] = []
        # (a session with a turn in the queue keeps its pin past the TTL: kv/session_pins.py)
        self.kv.expire_sessions({s.request.session for s in self.waiting if s.request.session is not None}
                                if self.config.session_ttl_s else ())
        self._make_room(preempted)
        self.kv.trim()  # pages the prefix cache gave back
        self._admit(admitted)
        prefill, deadline = self._plan_prefill()
        return StepPlan(started=started, plan_s=time.perf_counter() - started, admitted=tuple(admitted),
                        preempted=tuple(preempted), prefill=prefill, deadline=deadline)

    def update(self, plan: StepPlan, out: StepOutput) -> None:
        """After the runner executed ``plan`` (``out``: what ran, how long): prompts it did not reach back at
        the head of the queue, the finished prompts' bookkeeping, shared-prefix snapshots, the measured
        rates and the step's statistics."""
        ran, rest = plan.prefill[: out.prefill_ran], plan.prefill[out.prefill_ran :]
        if rest:  # the clock stopped the step's prefill: the rest goes first next step, in its order
            queued = {id(s) for s in self.prefilling}
            back = list({id(s): s for w in rest for s in w.seqs if id(s) not in queued}.values())
            self.prefilling.extendleft(reversed(back))
        for work in ran:
            if work.kind == "chunk":
                for s in work.seqs:
                    self.kv.commit_split(s)
        self._prompts_done([s for work in ran for s in work.finishes])
        self.stats.on_step_times(plan, out)
        if out.prefill_tokens >= 16 and out.prefill_s > 0:
            self._observe_prefill(out.prefill_tokens / out.prefill_s)
        other = time.perf_counter() - plan.started - out.prefill_s
        if out.fused_tokens and self._other_step_s:
            # The chunk ran in the decode forward: its cost is what the step took beyond a plain one (at
            # least a tenth of it: the plain steps' average is noisy); the plain steps' average stays theirs.
            self._observe_prefill(out.fused_tokens / max(other - self._other_step_s, 0.1 * other))
        else:
            self._other_step_s = other if not self._other_step_s else 0.8 * self._other_step_s + 0.2 * other
        if out.plain_rows and not (out.joined or out.prefill_tokens or out.fused_tokens):  # a steady decode step
            self.speculator.observe_plain_step(out.plain_rows, other)
        # Rows that left during the step may have handed the prefix cache pages after its last eviction (a row's
        # pages go back once the step's forward no longer reads them): within its limit between steps.
        self.kv.evict_freed()
        self.stats.on_step(len(self.running), self.batch_kv_bytes(), self.kv_bytes_held())
        if self._trace is not None:
            self._trace.record(plan, out, self.stats, self.kv.meter.moved)
        memory_recovery.step_succeeded(self)

    def _observe_prefill(self, rate: float) -> None:
        """A measured prefill rate (tokens per second) into the running estimate."""
        self._prefill_rate = rate if self._prefill_rate is None else 0.7 * self._prefill_rate + 0.3 * rate

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

    def _admit(self, admitted: list) -> None:
        """Admit by what a sequence takes now (its context plus the watermark), not by its max_tokens:
        rows grow as they decode and the least urgent are preempted if memory runs short."""
        active = len(self.running) + len(self.prefilling)
        room = self.kv.admission_room() - sum(self.kv.context_bytes(s) for s in self.prefilling)
        groups: dict = {}
        for s in list(self.running) + list(self.prefilling):
            groups[s.request.group] = groups.get(s.request.group, 0) + 1
        while self.waiting and active < self.config.max_batch_size:
            seq = self._next_fair(groups)
            if self.config.session_ttl_s:  # a turn whose context its pin holds goes first (kv/session_pins.py)
                seq = kept_turn_that_fits(self.waiting, seq, room, self.kv) or seq
            need = self.kv.context_bytes(seq)
            if need > room:
                # Kept sessions give way only to a request that would otherwise wait on nothing: while rows run,
                # it waits for them (the pins are bounded by their share, so the rows' share of the budget frees
                # up as they finish) rather than costing a waiting agent its context (kv/session_pins.py).
                if not active and self.kv.yield_session(seq.request.session, need - room):
                    room = self.kv.admission_room() - sum(self.kv.context_bytes(s) for s in self.prefilling)
                    continue
                if active:
                    break
                # Always admit when idle, so one oversized request still runs rather than waiting forever.
            self.waiting.remove(seq)
            self.prefilling.append(seq)
            admitted.append(seq)
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

    # -- introspection (engine thread) ----------------------------------------------------------
    def memory_stats(self) -> dict:
        forwards = self.runner.forwards.stats() if self.runner.forwards is not None else {}
        return {**self.kv.memory_stats(), **forwards, "preemptions": self.preemptions, **mlx_memory()}
