"""A plain decode step as one compiled MLX graph: ``Engine(compile_decode=True)`` or ``PARALLM_COMPILE_DECODE=1``
(off by default).

Why: on a GPU a short decode step is bound by the host thread (docs/benchmarks-archive.md, "An H100: the step
is the host encoding MLX's kernels, for mlx-lm too"): Python building the graph (well over a thousand MLX
primitives for a 36-layer model) and MLX encoding its kernels, for mlx-lm's BatchGenerator as for ParaLLM.
``mx.compile`` traces the step once and then replays the tape: no Python per layer, and chains of elementwise
operations fused into one kernel each (fewer kernels to encode).

What it takes: every value that changes from step to step must be an input array, never a Python number
the trace would freeze. The step compiled here is the kept working set's *append* step
(``kv.decode_working_set``): between two plain decode steps of the same rows each row's newest token goes
to the same column of the kept ``(B, KV heads, capacity, D)`` arrays. So the step's inputs are the tokens,
each row's RoPE position, that column and each row's first real column (its left padding); its state is
each layer's kept arrays, written by a ``slice_update`` (in place, as the eager step's: nothing references
the old arrays once the call returns). The page pool is not in the graph: as after an eager append step, it
takes the kept arrays' new columns when the lane flushes them (``DecodeWorkingSet.flush``; the pool grows
while rows decode, and a pool inside the graph would make every growth a new trace). Attention reads the
whole capacity under a mask built in the graph (the columns after this step's are masked), so the shapes
stay fixed until the kept arrays are rebuilt (their capacity a multiple of ``decode_working_set.ROOM``) or
the rows change; those steps run eagerly, and the next append traces anew (a trace costs several eager steps'
host time: docs/benchmarks-archive.md, "The plain decode step as one compiled graph; llama.cpp on the default
agents trace"). Traces are kept per lane in a small LRU keyed by their shapes, each in a function object of
its own (MLX erases a compiled function's traces when the object goes).

Where it applies (:func:`applies`): a plain one-token step of a lane in append mode, float KV, no shared
prefix, no LoRA adapters, no per-row model extras, attention not read from the pool by a kernel. A model
whose trace fails is refused, and that lane runs eagerly from then on: one whose forward never asks the
cache for its mask (:class:`NotCompilable`: it would attend over the unwritten columns), or one whose Python
needs values a trace does not have. Everything else runs eagerly.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import mlx.core as mx

from parallm_engine.runner import forward, lora

logger = logging.getLogger("parallm_engine")

#: Compiled steps (one per shape) a lane keeps.
TRACES = 4


class NotCompilable(Exception):
    """The model's forward cannot run as the compiled step (it never asked the cache for its mask)."""


class _StepInputs:
    """What every layer of one traced step reads."""

    def __init__(self, offset, mask, column):
        self.offset, self.mask, self.column = offset, mask, column
        self.masked = False  # whether the model asked for the mask (see NotCompilable)


class _TracedLayerKV:
    """One layer's cache as the model sees it while the step is traced: ``PagedLayerKV``'s append step."""

    fused = None  # the attention hook's other layouts (kv.fused_step, ragged steps, the shared prefix)
    ragged = None
    shared_keys = None

    def __init__(self, step: _StepInputs, ws_k, ws_v):
        self.step = step
        self.offset = step.offset
        self.ws_k, self.ws_v = ws_k, ws_v

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.ws_k = mx.slice_update(self.ws_k, keys, self.step.column, axes=(2,))
        self.ws_v = mx.slice_update(self.ws_v, values, self.step.column, axes=(2,))
        return self.ws_k, self.ws_v

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window layer got a full-attention cache")
        self.step.masked = True
        return self.step.mask


def _traced_step(model):
    """A new compiled function for one shape of the step (a function object of its own: see the docstring)."""

    def step(x, offset, starts, column, state):
        capacity = state[0][0].shape[2]
        cols = mx.arange(capacity, dtype=mx.int32)[None]
        mask = ((cols >= starts[:, None]) & (cols <= column))[:, None, None, :]
        inputs = _StepInputs(offset, mask, column)
        caches = [_TracedLayerKV(inputs, *layer) for layer in state]
        logits = forward.plain(model, x, caches)
        if not inputs.masked:
            raise NotCompilable("the model's attention does not take its mask from the cache")
        return logits[:, -1, :].astype(mx.float32), [(c.ws_k, c.ws_v) for c in caches]

    return mx.compile(step)


class CompiledSteps:
    """A lane's compiled decode steps (an LRU of :data:`TRACES` shapes) and what they counted."""

    def __init__(self):
        self._fns: OrderedDict = OrderedDict()
        self.refused = False  # the model cannot run compiled (NotCompilable): eager from now on
        self.steps = 0
        self.traces = 0

    def _fn(self, model, key):
        """The compiled step for ``key`` and whether it is new (its first call traces the model)."""
        fn = self._fns.pop(key, None)
        new = fn is None
        if new:
            fn = _traced_step(model)
            self.traces += 1
            while len(self._fns) >= TRACES:
                self._fns.popitem(last=False)
        self._fns[key] = fn
        return fn, new

    def forward(self, model, kv, x: mx.array) -> mx.array | None:
        """Lazy float32 logits (B, V) of lane KV ``kv``'s append step for tokens ``x`` (B, 1), its layers'
        kept arrays replaced by the step's outputs (the pool takes the column at the lane's next flush);
        None where the model is refused (nothing was changed)."""
        layers = kv.layers
        first = layers[0]
        state = [layer.ws for layer in layers]
        key = (id(model), x.shape[0], first.ws[0].shape[2], first.ws[0].dtype)
        column = mx.array([kv.ws.table.shape[1] - 1], dtype=mx.int32)
        fn, new = self._fn(model, key)
        try:
            logits, out = fn(x, first.offset, kv.step_starts, column, state)
        except Exception as exc:
            if not new:  # a replay failing is the step failing (memory, ...), as an eager step's would
                raise
            # Tracing failed: the model's forward cannot be a compiled step (NotCompilable, or Python that
            # needs values the trace does not have). Nothing was changed; this lane runs eagerly from now on.
            logger.warning("decode steps run eagerly: the compiled step refused this model (%s: %s)",
                           type(exc).__name__, exc)
            self._fns.clear()
            self.refused = True
            return None
        offset = first.offset + 1
        for layer, (wk, wv) in zip(layers, out):
            kv.ws.appended(layer, wk, wv)  # the pool takes the column later, as after an eager append step
            layer.offset = offset
        self.steps += 1
        return logits


def applies(steps: CompiledSteps, kv, model, native) -> bool:
    """Whether lane KV ``kv``'s step just begun (one position per row) can run compiled. Append mode already
    means a plain one-token step of float KV that no kernel reads from the pool (``DecodeWorkingSet.plan``)."""
    return (not steps.refused and native is None and not kv.shared_len
            and kv.ws.mode == "append" and all(layer.ws is not None for layer in kv.layers)
            and not hasattr(model, "decode_kwargs") and lora.runtime(model) is None)
