"""The model runner: executes the scheduler's plan for a step (``step_plan.StepPlan``).

Every forward of the engine starts here: the prefill of a long prompt's chunk or of a group of short
contexts, one forward per decode lane writing their KV straight into their rows' pages
(``kv.paged_prefill``; the mixed layout: a chunk through mlx-lm's caches), and the decode step of the running
batch (``decode_runner.DecodeRunner``, its base: sampling, delivery, the pipelined step in flight,
speculative verify steps), which computes the step's prefill items in its own forward where the
scheduler marked them ``fused`` (``kv.fused_step``). The engine's attention hook and, on the CPU, its kernels are installed on
the model here, bound to this model's own module instances (nothing process-wide); per-family quirks
come from the family adapter (``family_adapters``). The KV the forwards read and write is the KV cache
manager's (``kv_cache_manager``): the runner asks it for the prompts' rows (or caches), joins the
prompts an item finishes to the batch through it and retires the rows that finish (``retire``), and
reports both in the step's output; ``Scheduler.update`` does the rest of the bookkeeping.
"""

from __future__ import annotations

import time

import mlx.core as mx

from parallm_engine.runner import batch_invariance, cpu_kernels, forward
from parallm_engine.runner.batch_forward import BatchForward

from parallm_engine.kv import kv_quant
from parallm_engine.kv.fused_step import FusedWork
from parallm_engine.runner.logits_head import split_head
from parallm_engine.runner.decode_runner import DecodeRunner
from parallm_engine.kv.paged_prefill import PagedPrefillStep
from parallm_engine.spec.speculative import TOKEN_BUDGET, Speculator
from parallm_engine.runner.step_plan import PrefillWork, StepOutput, StepPlan

NO_SPECULATION_MIXED = ("speculative decoding needs KV that can be rolled back; this model has sliding-window "
                        "or recurrent layers (cache layout 'mixed'), which is not supported yet")


class ModelRunner(DecodeRunner):
    def __init__(self, model, model_info, config, stats, kv, out, family):
        self.kv = kv
        self.family = family
        family.install(model)
        hooked = cpu_kernels.install(model, model_info.context_window, kernels=config.cpu_kernels)
        self.cpu_kernels = config.cpu_kernels
        # After the kernels: the modules they switched compute their rows alone and need no padding.
        self.batch_invariance = batch_invariance.install(model) if config.batch_invariant else None
        # Build/load the native kernels now, not in the middle of the first decode step.
        self.native_kernels = bool(self.cpu_kernels and cpu_kernels.native_available())
        kv.use_attention_hook(hooked)
        # Speculative decoding needs KV it can roll back: the engine's own (attention layout) only; and
        # not quantized KV (kv_quant.NO_SPECULATION says why).
        self.no_speculation = None if kv.rolls_back else NO_SPECULATION_MIXED
        if kv.kv_format is not None:
            self.no_speculation = kv_quant.NO_SPECULATION
        # Positions one verify step may compute: on the CPU, what the native linear takes per lane (past it
        # a lane's projections go to BLAS at several times the cost per position).
        with cpu_kernels.solo_lane(config.decode_lanes == 1):  # one lane has the kernels' threads to itself
            native_rows = cpu_kernels.native_linear_rows() if self.native_kernels else 0
        budget = min(TOKEN_BUDGET, native_rows * config.decode_lanes) if native_rows else TOKEN_BUDGET
        speculator = Speculator(config.speculative, stats, model_info.context_window, token_budget=budget) \
            if self.no_speculation is None else None
        if speculator is not None:  # a draft model's KV for its rows counts with the rows (draft_model.py)
            kv.draft_kv_bytes = speculator.draft_rows.nbytes
        # The paged batch's forwards (the mixed layout's is ``decode_forward``'s own).
        self.forwards = BatchForward(kv.batch, config.compile_decode) if kv.takes_ragged_steps else None
        # Decode steps that compute a prompt's chunk in their forward (kv.fused_step) need the exact split
        # of the model into hidden states and head, and attention through the hook as a ragged step's.
        self.split = split_head(model) if config.fuse_prefill and self.forwards is not None \
            and self.forwards.ragged_ok(model) else None
        # Prefill forwards that run at once: a multi-lane CPU without the native kernels runs a forward per
        # lane's stream, each on one core (``_prefill_paged``), so long contexts are chunked one per stream.
        self.prefill_streams = 1 if self.native_kernels else kv.prefill_lanes
        super().__init__(model, kv.batch, out, stats, pipeline=config.pipeline, speculator=speculator)

    # -- the step -------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run ``plan``: its prefill items in order (none started after its deadline, at least one run),
        the prompts each finishes joined to the batch through the KV cache manager, then one decode step
        for every running row, with the plan's fused work in its forward (``kv.fused_step``; alone where no
        row was left to decode). Returns what ran and how long it took; the plan is not written."""
        self.plain_rows = 0
        out = StepOutput()
        with cpu_kernels.enabled(self.cpu_kernels):
            t0 = time.perf_counter()
            before = self.stats.prefill_tokens
            self._fused = None
            try:
                for work in plan.prefill:
                    if out.prefill_ran and plan.deadline is not None and time.perf_counter() >= plan.deadline:
                        break  # the rest waits for the next step (Scheduler.update)
                    self.prefill(work)
                    out.prefill_ran += 1
                    joins = [s for s in work.finishes if not s.embedding]  # embedding rows are delivered
                    if joins:
                        self.kv.commit_prompts(joins, work.fused)
                        out.joined += joins
                        for s in joins:  # the usage's cached tokens, before any of their tokens is delivered
                            if not s.preemptions:
                                self.stats.on_prompt_done(s.request, s.cached_tokens if s.index == 0 else None)
            finally:
                self.kv.end_reads()
            fused, self._fused = self._fused, None
            out.prefill_s = time.perf_counter() - t0
            out.prefill_tokens = self.stats.prefill_tokens - before
            self.kv.join_late(out.joined)
            t_decode = time.perf_counter()
            built = False
            try:
                if self.batch.running:
                    self.kv.reserve_decode()
                    out.decode_rows = list(self.batch.running)
                    self.step(fused)
                elif self.in_flight:
                    self.flush()
                if fused is not None and not fused.ran:
                    # No row decoded this step (the rows all ended when the step in flight was delivered):
                    # the prompts' forward alone, as a lane that decodes nothing runs it. Only unfinished
                    # prompts: one the work finished is a decode row of this step.
                    assert not fused.finishes(), "a prompt joined the batch without its prefill"
                    self.forwards.forward_prompts(self.model, fused)
                    mx.eval(fused.arrays)
                built = True
            finally:
                self.kv.index_fused(built)  # the prompts it finished, into the tree once their forward is built
            if fused is not None:
                self.stats.prefill_tokens += fused.n_tokens
                self.stats.fused_prefill_tokens += fused.n_tokens
                self.stats.fused_prefill_chunks += fused.items
                out.fused_tokens = fused.n_tokens
        out.decode_s = time.perf_counter() - t_decode
        out.plain_rows = self.plain_rows
        out.finished, self.finished = self.finished, []
        return out

    # -- rows leaving -----------------------------------------------------------------------------
    def retire(self, seqs: list) -> None:
        """Finished rows leave the batch at once, their KV kept in the prefix cache for the next turn."""
        for s in seqs:
            self.kv.commit_row(s)
            if s.request.session is not None:  # its next turn finds this context (kv/session_pins.py)
                self.kv.keep_session(s.request.session, s)
        self.drop_rows({id(s) for s in seqs})
        self.finished += seqs

    def drop_rows(self, rows: set[int]) -> None:
        """The rows whose ``id()`` is in ``rows`` leave the batch, the step in flight and the speculator's
        draft state (retired, preempted or cancelled); their pages go back (``kv.free_rows``)."""
        self.kv.free_rows(rows)
        if self.speculator is not None:
            self.speculator.drop(rows)
        self.drop(rows)
        self.kv.evict_freed()

    def decode_forward(self, inputs: mx.array, work=None) -> mx.array:
        """The decode step's forward: the paged batch's lanes (``batch_forward``), or the mixed layout's
        running rows over mlx-lm's batched caches (``kv.model_caches.MixedDecodeBatch``; it never fuses)."""
        if self.forwards is None:
            return forward.decode(self.model, inputs[:, None], self.batch.caches, self.batch.running)[:, -1, :] \
                .astype(mx.float32)
        return self.forwards.forward(self.model, inputs, work)

    def fuses(self, seq) -> bool:
        """Whether ``seq``'s prefill may run in the decode forward (``kv.fused_step``): the model splits
        exactly into its hidden-state forward and its head (``logits_head``), its attention runs through
        the engine's hook as a ragged step's does, and nothing per row needs more than token ids and its
        LoRA adapter (no image inputs, no embedding pooling)."""
        return self.split is not None and not seq.embedding and getattr(seq.request, "vision", None) is None

    def prefill(self, work: PrefillWork) -> None:
        """One prefill work item: the sequences' rows (or caches) opened and ``work.new`` more context
        tokens of each computed into them. Work the scheduler fused into the decode step is only prepared
        here (``_prepare_fused``)."""
        seqs = work.seqs
        if work.fused:
            self._prepare_fused(work)
        elif work.kind == "cached":  # the whole context is cached: no forward
            self.kv.open_rows(list(seqs))
        elif self.kv.prefills_alone:
            self._prefill_chunk(seqs[0], work.new[0])
        elif all(s.embedding and s.computed == 0 and n == len(s.prefill_ids) for s, n in zip(seqs, work.new)):
            self._embed_texts(list(seqs), list(work.new))
        else:
            self._prefill_paged(list(seqs), list(work.new))

    def _embed_texts(self, seqs: list, new: list[int]) -> None:
        """Embedding texts each computed whole in one forward: their KV is dropped once they are pooled, so
        none is written (no rows, no pages, no attention over pages); right-padded, not left."""
        L = max(new)
        tokens = mx.array([s.prefill_ids + [0] * (L - n) for s, n in zip(seqs, new)])
        forward.texts(self.model, tokens, seqs, new)
        mx.eval(forward.pooled(seqs))
        for s, n in zip(seqs, new):
            s.computed += n
        self.stats.prefill_tokens += sum(new)
        self.stats.prefill_forwards += 1

    def _prepare_fused(self, work: PrefillWork) -> None:
        """The work the decode forward computes (``kv.fused_step``): rows opened and grown by the new
        tokens' pages, positions advanced (the prompts it finishes join the batch before the forward, their
        last context token one of its decode rows)."""
        seqs, new = list(work.seqs), list(work.new)
        self.kv.open_rows(seqs)
        rows = [s.cache for s in seqs]
        tokens = []
        for s, n, r in zip(seqs, new, rows):
            tokens.append(s.prefill_ids[s.computed : s.computed + n])
            r.row.grow(r.lane.kv.pool, n)
            s.computed += n
        if self._fused is None:
            self._fused = FusedWork(self.split)
        self._fused.add(seqs, new, rows, tokens)

    def _prefill_paged(self, seqs: list, new: list[int]) -> None:
        """Attention layout: ``new[i]`` more context tokens of each sequence, their KV written once into
        the rows' pages (``paged_prefill``). Logits are never evaluated: the last context token runs in the
        decode step. Each lane's rows run as one forward on its stream, except on a multi-lane CPU without
        the native kernels (MLX runs each stream on one core): there they are split into token-balanced
        shares that run at the same time on the lanes' streams, and write their KV after the forwards."""
        self.kv.open_rows(seqs)
        batch = self.batch
        shared = batch.shared.kv if batch.shared is not None else None
        nat = cpu_kernels.native_module()
        n_shares = len(batch.lanes) if nat is None else 1
        steps, k = [], 0
        for lane in batch.lanes:
            mine = [(s, n) for s, n in zip(seqs, new) if s.cache.lane is lane]
            shares = split_balanced(mine, [n for _, n in mine], n_shares)
            for share in shares:
                with batch.lane_contexts()[k % len(batch.lanes)]:  # the next lane's stream
                    steps.append((lane, self._forward_share(lane, share, shared, nat, deferred=len(shares) > 1)))
                k += 1
        mx.eval([a for _, step in steps for a in step.arrays()] + forward.pooled(seqs))
        pools = []
        for lane, step in steps:
            with lane.context():
                pools += step.commit()
        if pools:
            mx.eval(pools)
        for s, n in zip(seqs, new):
            s.computed += n
        self.stats.prefill_tokens += sum(new)
        self.stats.prefill_forwards += len(steps)

    def _forward_share(self, lane, share: list[tuple], shared, nat, deferred: bool) -> PagedPrefillStep:
        """Build (lazily) one share's forward: ``share`` is ``(sequence, new tokens)`` of rows in ``lane``."""
        step = PagedPrefillStep(lane.kv, [s.cache for s, _ in share], [n for _, n in share], shared, native=nat,
                                reads_pool=self.batch.attention_reads_pool, deferred=deferred)
        L = max(n for _, n in share)
        tokens = mx.array([[0] * (L - n) + s.prefill_ids[s.computed : s.computed + n] for s, n in share])
        forward.prefill(self.model, tokens, step.layers, [(s, s.computed, n) for s, n in share])
        return step

    def _prefill_chunk(self, seq, n: int) -> None:
        """Mixed layout: ``n`` more context tokens of one sequence through its own caches."""
        self.kv.open_rows([seq])
        end = seq.computed + n
        tokens = mx.array(seq.prefill_ids[seq.computed : end])[None]
        forward.prefill(self.model, tokens, seq.cache, [(seq, seq.computed, n)])
        seq.computed = end
        self.stats.prefill_tokens += n
        self.stats.prefill_forwards += 1
        mx.eval(self.kv.cache_state(seq.cache) + forward.pooled([seq]))


def split_balanced(items: list, weights: list[int], n: int) -> list[list]:
    """At most ``n`` non-empty shares of ``items`` with near-equal total weight (largest first into
    the lightest share), each keeping the items' original order."""
    if n <= 1 or len(items) <= 1:
        return [list(items)] if items else []
    loads = [0] * n
    owner = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: -weights[i]):
        g = loads.index(min(loads))
        loads[g] += weights[i]
        owner[i] = g
    shares = [[x for x, o in zip(items, owner) if o == g] for g in range(n)]
    return [share for share in shares if share]
