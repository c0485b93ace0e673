"""The model runner: executes the scheduler's plan for a step (``step_plan.StepPlan``).

Every forward of the engine starts here: the prefill of one sequence's chunk through its own caches,
the batched prefill of several short contexts (``prefill_runner``), and the decode step of the running
batch (``decode_runner.DecodeRunner``, its base: sampling, delivery, the pipelined step in flight,
speculative verify steps). The engine's attention hook and, on the CPU, its kernels are installed on
the model here, bound to this model's own module instances (nothing process-wide); per-family quirks
come from the family adapter (``family_adapters``). The KV the forwards read and write is the KV cache
manager's (``kv_cache_manager``): the runner asks it for a prompt's caches and the arrays to evaluate,
and hands the finished prompts back through the plan (the scheduler commits them).
"""

from __future__ import annotations

import time

import mlx.core as mx

from parallm_engine.runner import cpu_kernels

from parallm_engine.embed import embedding

from parallm_engine.kv import kv_quant
from parallm_engine.runner.decode_runner import DecodeRunner
from parallm_engine.runner.prefill_runner import run_prefill_group
from parallm_engine.spec.speculative import TOKEN_BUDGET, Speculator
from parallm_engine.core.step_plan import PrefillWork, StepPlan

NO_SPECULATION_MIXED = ("speculative decoding needs KV that can be rolled back; this model has sliding-window "
                        "or recurrent layers (cache layout 'mixed'), which is not supported yet")


class ModelRunner(DecodeRunner):
    def __init__(self, model, model_info, config, stats, kv, out, family, *, retire):
        self.kv = kv
        self.family = family
        hooked = cpu_kernels.install(model, model_info.context_window, kernels=config.cpu_kernels)
        self.cpu_kernels = config.cpu_kernels
        # Build/load the native kernels now, not in the middle of the first decode step.
        self.native_kernels = bool(self.cpu_kernels and cpu_kernels.native_available())
        kv.use_attention_hook(hooked)
        # Speculative decoding needs KV it can roll back: the engine's own (attention layout) only; and
        # not quantized KV (kv_quant.NO_SPECULATION says why).
        self.no_speculation = None if kv.layout == "attention" else NO_SPECULATION_MIXED
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
        family.prepare_batch(kv.batch, kv.layout)
        super().__init__(model, kv.batch, out, stats, pipeline=config.pipeline, speculator=speculator,
                         retire=retire)

    # -- the step -------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> None:
        """Run ``plan``: its prefill work as the scheduler hands it out (each item planned once the one
        before has run), the mixed layout's late joins, then one decode step for every running row."""
        self.plain_rows = 0
        with cpu_kernels.enabled(self.cpu_kernels):
            t0 = time.perf_counter()
            before = self.stats.prefill_tokens
            try:
                for work in plan.prefill:
                    self.prefill(work)
            finally:
                self.kv.end_reads()
            plan.prefill_s = time.perf_counter() - t0
            plan.prefill_tokens = self.stats.prefill_tokens - before
            self.kv.join_late(plan.joined)
            t_decode = time.perf_counter()
            if self.batch.running:
                self.kv.reserve_decode()
                plan.decode_rows = list(self.batch.running)
                self.step()
            elif self.in_flight:
                self.flush()
        plan.decode_s = time.perf_counter() - t_decode

    def prefill(self, work: PrefillWork) -> None:
        """One prefill work item; the prompts it finished go to ``work.finished`` with their caches."""
        if work.kind == "cached":  # the whole context is cached: no forward
            seq = work.seqs[0]
            work.finished = [(seq, self.kv.prompt_cache(seq))]
        elif work.kind == "chunk":
            self._prefill_chunk(work.seqs[0], work.n_tokens)
            seq = work.seqs[0]
            work.finished = [(seq, seq.cache)] if seq.pos == len(seq.prefill_ids) else []
        else:
            work.finished = run_prefill_group(self.model, self.batch, work.seqs, self.kv.n_layers, self.stats,
                                              share_prefix=self.kv.share_prefix, mask_5d=self.family.mask_5d,
                                              fmt=self.kv.kv_format)

    def _prefill_chunk(self, seq, n: int) -> None:
        """``n`` more context tokens of one sequence through its own caches."""
        if seq.cache is None:
            seq.cache = self.kv.prompt_cache(seq)
            seq.prefix_kv = None
        end = seq.pos + n
        tokens = mx.array(seq.prefill_ids[seq.pos : end])[None]
        embedding.prefill_forward(self.model, tokens, self.family.prefill_caches(seq.cache), [(seq, seq.pos, n)])
        seq.pos = end
        self.stats.prefill_tokens += n
        self.stats.prefill_forwards += 1
        mx.eval(self.kv.cache_state(seq.cache) + embedding.pooled_arrays([seq]))
