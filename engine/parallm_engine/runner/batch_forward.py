"""The running batch's forwards: each decode lane's rows through the model on the lane's stream (the
batch's membership and KV are kv's: ``kv/decode_batch.py``).

A plain decode step (one token per row, with the step's fused prefill work where the scheduler marked it:
``kv.fused_step``), a block of W positions per row or a ragged step of each row's own positions
(speculative verification), and the fused work's prompts alone where no row decoded. Logits follow the
batch's row order (lane by lane). A lane's plain steps may run as one compiled graph
(``compiled_decode``); the compiled steps are the runner's, one per lane.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from parallm_engine.runner import cpu_kernels, forward
from parallm_engine.runner.compiled_decode import CompiledSteps, applies as compiled_applies
from parallm_engine.kv.decode_batch import DecodeBatch, DecodeLane
from parallm_engine.kv.fused_step import FusedLayerKV, FusedWork, PromptLayout
from parallm_engine.kv.paged_prefill import PagedPrefillStep


class BatchForward:
    def __init__(self, batch: DecodeBatch, compile_steps: bool = False):
        self.batch = batch
        # Each lane's plain decode steps as compiled graphs (the engine's ``compile_decode`` option), by lane.
        self.compile_steps = compile_steps
        self.compiled = [CompiledSteps() for _ in batch.lanes]

    def stats(self) -> dict:
        """Plain decode steps run as compiled graphs (``compiled_decode``), and the traces they took."""
        return {"decode_compiled_steps": sum(c.steps for c in self.compiled),
                "decode_compile_traces": sum(c.traces for c in self.compiled)}

    def forward(self, model, tokens: mx.array, work: FusedWork | None = None) -> mx.array:
        """Lazy float32 logits, one row per running sequence, for ``tokens`` (one per row): the
        model's own forward (final norm, soft-caps and logit scaling included). ``work``: the step's prefill
        work, computed in the forward of the lanes its rows are in (``kv.fused_step``)."""
        return self._per_lane(model, tokens[:, None], last_only=True, work=work)

    def forward_block(self, model, tokens: mx.array) -> mx.array:
        """Lazy float32 logits (B, W, V) for ``tokens`` (B, W): W positions per row in one forward
        (speculative verification); :meth:`rollback_rows` then drops the positions each row does not keep."""
        return self._per_lane(model, tokens, last_only=False)

    def ragged_ok(self, model) -> bool:
        """Whether :meth:`forward_ragged` can run ``model``: its attention goes through the engine's hook
        (which lays a ragged step's positions out as the rows' rectangle; ``attention_reads_pool`` says the
        keys and values go only there) and it takes no per-row extras."""
        return self.batch.attention_reads_pool and not hasattr(model, "decode_kwargs")

    def forward_ragged(self, model, rows: list[list[int]]) -> mx.array:
        """Lazy float32 logits (N, V) for each row's own positions ``rows[i]`` (rows in row order, a row's
        positions in order; N their total): the projections and MLP compute only these N positions, not a
        (B, max width) rectangle (speculative verification, where rows draft different numbers of tokens).
        :meth:`rollback_rows` then drops the positions each row does not keep. Needs :meth:`ragged_ok`."""
        return self._per_lane(model, None, last_only=True, rows=rows)

    def _per_lane(self, model, tokens: mx.array | None, last_only: bool, rows: list[list[int]] | None = None,
                  work: FusedWork | None = None):
        """Each lane's rows through the model on the lane's stream; the lanes' logits in row order.
        ``rows``: a ragged step instead of ``tokens`` (one model row per position); ``work``: see
        :meth:`forward`. A distributed pipeline's lanes are its micro-batches (``forward.micro_batched``)."""
        fused = {id(lane): work.in_lane(lane) for lane in self.batch.lanes} if work is not None else {}
        solo = sum(1 for lane in self.batch.lanes if lane.seqs or fused.get(id(lane))) == 1  # one lane has the cores
        nat = cpu_kernels.native_module()
        with forward.micro_batched(model, self.batch.micro_batches and not solo):
            parts = self._lane_forwards(model, tokens, last_only, rows, work, fused, solo, nat)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def _lane_forwards(self, model, tokens, last_only: bool, rows, work, fused: dict, solo: bool, nat) -> list:
        """The lanes' (lazy) logits, lane by lane."""
        parts = []
        start = 0
        for lane, compiled in zip(self.batch.lanes, self.compiled):
            n = len(lane.seqs)
            prompts = fused.get(id(lane))
            if not n and not prompts:
                continue
            mine = None
            lane.kv.ws.limit = None if self.batch.working_set_limit is None else self.batch.working_set_limit // len(self.batch.lanes)
            with lane.context():
                if prompts:  # the work's rows in this lane run in its forward (alone where the lane decodes nothing)
                    with cpu_kernels.solo_lane(solo):
                        logits = self._fused_forward(model, lane, tokens[start : start + n] if n else None,
                                                     work, prompts, nat)
                    if logits is not None:
                        parts.append(logits)
                    start += n
                    continue
                if rows is not None:
                    mine = rows[start : start + n]
                    lane.kv.begin([len(r) for r in mine], nat, self.batch.attention_reads_pool)
                    x = mx.array([t for r in mine for t in r], dtype=mx.int32)[:, None]
                else:
                    x = tokens if n == len(tokens) else tokens[start : start + n]
                    lane.kv.begin(x.shape[1], nat, self.batch.attention_reads_pool)
                logits = None
                if mine is None and self.compile_steps and compiled_applies(compiled, lane.kv, model, nat):
                    logits = compiled.forward(model, lane.kv, x)  # (B, V): the step as one compiled graph
                if logits is None:
                    with cpu_kernels.solo_lane(solo):
                        logits = forward.decode(model, x, lane.kv.layers, lane.seqs,
                                                None if mine is None else [len(r) for r in mine])
                else:
                    logits = logits[:, None]  # (B, 1, V) as the model's own
                self.batch.meter.decoded += x.shape[0] * x.shape[1]
                parts.append((logits[:, -1, :] if last_only else logits).astype(mx.float32))
            start += n
        return parts

    def forward_prompts(self, model, work: FusedWork) -> None:
        """Fused work no decode step took: its prompts' forward alone in each lane they are in, as in a lane
        that decodes nothing (evaluate ``work.arrays``)."""
        nat = cpu_kernels.native_module()
        for lane in self.batch.lanes:
            mine = work.in_lane(lane)
            if mine:
                with lane.context():
                    self._fused_forward(model, lane, None, work, mine, nat)

    def _fused_forward(self, model, lane: DecodeLane, x: mx.array | None, work: FusedWork, mine: list[int],
                       nat) -> mx.array | None:
        """Lazy float32 logits of ``lane``'s rows (``x``: their tokens, (B, 1)), with the prefill ``work``'s
        rows ``mine`` (in this lane) in the same forward (``kv.fused_step``): B + n model rows, logits for the
        first B only. A lane with no rows (``x`` None) runs the prompts' forward alone (no logits). Each
        prefill item's prompts are one rectangle (``PromptLayout``) for their attention."""
        shared = self.batch.shared.kv if self.batch.shared is not None else None
        steps = [(run, PagedPrefillStep(lane.kv, [work.rows[i] for i in run], [work.new[i] for i in run], shared,
                                        native=nat, reads_pool=self.batch.attention_reads_pool, grown=True))
                 for run in work.by_item(mine)]
        if x is None:
            for run, step in steps:  # one forward per item: a rectangle of its own
                new = [work.new[i] for i in run]
                L = max(new)
                ids = mx.array([[0] * (L - n) + work.tokens[i] for i, n in zip(run, new)], dtype=mx.int32)
                forward.prompts(model, ids, step.layers, [work.seqs[i] for i in run])
            work.arrays += steps[-1][1].arrays()  # the lane's pools, as the last forward leaves them
            return None
        B = x.shape[0]
        lane.kv.begin(1, nat, self.batch.attention_reads_pool)  # after the step: a row that joined grows past its prompt
        new = [work.new[i] for i in mine]
        positions = np.concatenate([p + np.arange(work.new[i]) for run, step in steps
                                    for p, i in zip(step.starts, run)]).astype(np.int32)
        offset = mx.concatenate([lane.kv.layers[0].offset, mx.array(positions)])
        layouts, start = [], 0
        for run, _ in steps:
            layouts.append(PromptLayout([work.new[i] for i in run], start))
            start += layouts[-1].n
        caches = [FusedLayerKV(d, [(step.layers[l], layout) for (_, step), layout in zip(steps, layouts)], B, offset)
                  for l, d in enumerate(lane.kv.layers)]
        ids = mx.array([t for i in mine for t in work.tokens[i]], dtype=x.dtype)[:, None]
        logits = forward.fused(work.split, model, mx.concatenate([x, ids]), caches, lane.seqs,
                               [work.seqs[i] for i in mine], new)
        work.arrays += steps[-1][1].arrays()
        self.batch.meter.decoded += B
        return logits[:, -1, :].astype(mx.float32)
