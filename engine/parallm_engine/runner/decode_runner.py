"""The decode step: one forward of the running batch, sampling, delivery (``model_runner.ModelRunner``'s
base; the scheduler decides who runs, ``kv_cache_manager`` what memory they may take).

Pipelined when no running sequence needs host state that depends on the previous token (penalties):
the step's graph is built on the previous step's tokens while they are still being computed,
``async_eval`` starts it, and the host then detokenises, checks stops and delivers the previous step's
tokens while this one runs (as mlx-lm's generate loop does). A sequence that stopped has computed one
wasted step; its row is dropped. With grammar constraints in the batch, the forward is started first,
the previous step is delivered (advancing the matchers) and the masks are computed while it runs;
only the sampling waits. Rows whose reasoning budget may force a token (``reasoning_budget``) run the same way.

The step in flight (``pending``) belongs to this runner: the scheduler flushes it before the batch
changes shape under it (preemption) and drops rows from it when they leave. A row that finishes in a
delivery is retired at once (``ModelRunner.retire``: its KV into the prefix cache, its row freed), before
any further forward: a delivery may come in the middle of a step (the step in flight flushed before a
step that cannot be pipelined, or before speculation). The step reports them (``StepOutput.finished``).
"""

from __future__ import annotations

import time

import mlx.core as mx

from parallm_engine.sampling.constrained import apply_constraints
from parallm_engine.sampling.reasoning_budget import allow_tokens, force_tokens, forced_rows, row_grammars, row_openers
from parallm_engine.sampling.sampler import sample_batch


class DecodeRunner:
    def __init__(self, model, batch, out, stats, *, pipeline: bool, speculator):
        self.model = model
        self.batch = batch
        self.out = out  # OutputProcessor: detokenise, stops, deliver
        self.stats = stats
        self.pipeline = pipeline
        self.speculator = speculator  # None where speculation is refused for this engine
        self.finished: list = []  # rows retired since the last step's output was taken
        # A pipelined decode step in flight: (sequences, tokens, logprob rows, chosen logprobs).
        self.pending: tuple | None = None
        self.plain_rows = 0  # rows of this step's ordinary pipelined decode, for the speculator's costs

    def decode_forward(self, inputs: mx.array, work=None) -> mx.array:
        """Lazy float32 logits of the running rows for ``inputs`` (one token each), with ``work`` (the step's
        fused prefill) in the same forward (``ModelRunner.decode_forward``)."""
        raise NotImplementedError

    @property
    def in_flight(self) -> bool:
        return self.pending is not None

    def step(self, work=None) -> None:
        """One decode step for every running sequence (speculative where the speculator chooses to).
        ``work`` (``kv.fused_step.FusedWork``): the step's prefill work, computed in the same forward (the
        step is then a plain one; ``work.ran`` says whether it ran: not where no row was left)."""
        if work is None and self.speculator is not None and self.speculator.step(self):  # verified drafts
            self._retire_finished()
            return
        running = self.batch.running
        pipelined = self.pipeline and not any(s.sampler.params.needs_penalties for s in running)
        # Grammar masks and reasoning budgets depend on the previous token: it is delivered before sampling.
        constrained = pipelined and any(s.constraint is not None or (s.reasoning is not None and s.reasoning.live)
                                        for s in running)
        if self.speculator is not None and pipelined and self.pending is not None:
            # a pipelined step after another: its wall time is the step's cost (spec_policy)
            self.plain_rows = len(running)
        if self.pending is not None and not pipelined:
            self.flush()
            running = self.batch.running
            if not running:
                return
        if self.pending is not None:
            inputs = next_inputs(running, self.pending[0], self.pending[1])
        else:
            inputs = mx.array([s.last_token for s in running])
        logits = self.decode_forward(inputs, work)
        extra = []  # the prompts' writes: no logit may depend on them
        if work is not None:
            work.ran, extra = True, work.arrays
        for s in running:
            s.computed += 1
        self.stats.decode_steps += 1
        if constrained:  # masks need the previous tokens: deliver them while the forward runs
            mx.async_eval(logits, *extra)
            previous, self.pending = self.pending, None
            if previous is not None:
                self.out.deliver(*previous)
            sampled = self.sample(running, logits)
            self._launch(sampled, extra)
            self.pending = (list(running), *sampled)
        elif pipelined:
            sampled = self.sample(running, logits)
            self._launch(sampled, extra)
            previous, self.pending = self.pending, (list(running), *sampled)
            if previous is not None:
                self.out.deliver(*previous)
        else:
            if extra:
                mx.async_eval(extra)
            self.out.deliver(running, *self.sample(running, logits))
        self._retire_finished()

    def _launch(self, sampled, extra=()) -> None:
        """Start the step on the device. On a GPU this returns at once; MLX's CPU backend runs all but the
        last few of the graph's tasks before returning (it bounds the tasks in flight), so the time spent
        here counts as device time in the step breakdown (stats.step_breakdown_ms)."""
        t0 = time.perf_counter()
        mx.async_eval([x for x in sampled if x is not None] + list(extra))
        dt = time.perf_counter() - t0
        self.stats.device_wait_s += dt
        self.stats.launch_s += dt

    # The speculator's view of the engine: it verifies on this runner's batch and model.
    @property
    def running(self) -> list:
        return self.batch.running

    def flush(self) -> None:
        """Deliver the step in flight now (the batch is about to change or idle)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        self.out.deliver(*pending)
        self._retire_finished()

    def clear(self) -> None:
        """Forget the step in flight (its rows are being preempted or failed wholesale)."""
        self.pending = None

    def drop(self, rows: set[int]) -> None:
        """Rows whose ``id()`` is in ``rows`` leave the step in flight (their tokens are never delivered)."""
        if self.pending is None:
            return
        seqs, toks, lp_rows, chosen = self.pending
        kept = [i for i, s in enumerate(seqs) if id(s) not in rows]
        if not kept:
            self.pending = None
        elif len(kept) < len(seqs):
            sel = mx.array(kept)
            kept_set = set(kept)
            lp_keep = [r for r, i in enumerate([i for i, s in enumerate(seqs) if s.logprobs is not None])
                       if i in kept_set]
            self.pending = (
                [seqs[i] for i in kept],
                toks[sel],
                lp_rows[mx.array(lp_keep)] if lp_rows is not None and lp_keep else None,
                chosen[sel] if chosen is not None else None,
            )

    @staticmethod
    def sample(seqs: list, logits: mx.array):
        """Lazy: (tokens, logprobs rows for sequences that asked, chosen-token logprobs)."""
        samplers = [s.sampler for s in seqs]
        if any(s.constraint is not None for s in seqs):
            # Rows already finished (still in a pipelined step) are left unmasked; their tokens are dropped.
            # So are rows reasoning: the grammar is the answer's (reasoning_budget.row_grammars).
            logits = allow_tokens(apply_constraints(logits, row_grammars(seqs)), logits, row_openers(seqs))
        logits = force_tokens(logits, forced_rows(seqs))  # a reasoning budget's closing tokens
        toks, logprobs = sample_batch(logits, samplers)
        if logprobs is None:
            return toks, None, None
        rows = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        chosen = logprobs[mx.arange(len(seqs)), toks]
        return toks, logprobs[mx.array(rows)] if rows else None, chosen

    def _retire_finished(self) -> None:
        finished = [s for s in self.batch.running if s.finish_reason is not None]
        if finished:
            self.retire(finished)

    def retire(self, seqs: list) -> None:
        """Rows that finished leave the batch (``ModelRunner.retire``)."""
        raise NotImplementedError


def next_inputs(running: list, prev_seqs: list, prev_toks: mx.array) -> mx.array:
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
