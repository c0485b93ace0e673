"""Many LoRA adapters in one batched forward (BGMV-style, as Punica / S-LoRA do on CUDA).

Each linear layer some adapter targets gets a :class:`MultiLoRALinear` in its place on the model
instance (as mlx-lm's ``linear_to_lora_layers`` sets its ``LoRALinear``; nothing process-wide): it
keeps the layer it wraps (a plain ``nn.Linear``, or whatever the native-kernel / dtype paths switched
it to: ``cpu_kernels``, ``weights_dtype``) and reads the resident adapters' A and B stacked by slot
(slot 0: zeros, for rows with no adapter). Before each forward the runner says which adapter each model
row uses (:func:`adapter_rows`); the wrapper then computes, for every row at once,

    y = base(x) + scale[slot] * ((x @ A[slot]) @ B[slot])

with ``mx.gather_mm`` (each row's matrices are read by index, never copied per row): the same order of
operations as mlx-lm's ``LoRALinear`` for that row. DoRA rows are then rescaled by their adapter's
``m / ||W + scale B^T A^T||`` (precomputed per layer), as mlx-lm's ``DoRALinear``. A forward with no
adapter rows runs the base layers alone.

Model rows are the forward's batch rows: a decode step's running sequences (lane by lane), a prefill
group's sequences, a speculative rectangle's rows, and a ragged verify step's positions (one model row
per position: a sequence's slot repeated over its positions).
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from parallm_engine.models.lora_adapters import LoRAAdapter

_ATTR = "_parallm_lora"


class MultiLoRALinear(nn.Module):
    """A linear layer plus the low-rank updates of the adapters resident in ``runtime``, per row."""

    def __init__(self, base: nn.Module, path: str, runtime: "LoRARuntime"):
        super().__init__()
        self.base = base
        self._path = path
        self._runtime = runtime  # a plain attribute: not a parameter of the model

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        rt = self._runtime
        stack = rt.stacks.get(self._path) if rt.idx is not None else None
        if stack is None:
            return y
        a, b, scale, gain = stack
        idx = rt.idx
        z = mx.gather_mm(mx.gather_mm(x, a, rhs_indices=idx), b, rhs_indices=idx)
        out = y + (rt.row_scale(scale, z.dtype) * z).astype(x.dtype)
        if gain is None:
            return out
        row_gain = gain[idx].astype(x.dtype)[:, None, :]  # 1.0 for LoRA rows: exact
        bias = self.base.get("bias") if isinstance(self.base, nn.Module) else None
        if bias is None:
            return row_gain * out
        dora = rt.dora_rows[:, None, None]
        return mx.where(dora, row_gain * (out - bias) + bias, out)


class LoRARuntime:
    """The adapters resident in one model's stacks and the rows of the forward being built (engine thread)."""

    def __init__(self, model, max_slots: int):
        self.model = model
        self.max_slots = max_slots
        self.wrappers: dict[str, MultiLoRALinear] = {}
        self.slots: list[LoRAAdapter] = []  # slot i + 1
        self.stacks: dict[str, tuple] = {}  # layer path -> (A, B, scale, DoRA gain or None)
        self.stack_bytes = 0
        self.idx: mx.array | None = None  # slot per model row while a forward is built
        self.dora_rows: mx.array | None = None
        self._row_scales: dict = {}
        self.rebuilds = 0

    # -- rows of one forward -------------------------------------------------------------------
    @contextlib.contextmanager
    def bind(self, adapters: list):
        """Model row i uses ``adapters[i]`` (None: the base alone) while the forward's graph is built."""
        if not any(a is not None for a in adapters):
            yield
            return
        self._ensure_resident({a.key: a for a in adapters if a is not None})
        slot = {a.key: i + 1 for i, a in enumerate(self.slots)}
        rows = [slot[a.key] if a is not None else 0 for a in adapters]
        self.idx = mx.array(rows, dtype=mx.uint32)
        self.dora_rows = mx.array([a is not None and a.kind == "dora" for a in adapters])
        self._row_scales = {}
        try:
            yield
        finally:
            self.idx = self.dora_rows = None
            self._row_scales = {}

    def row_scale(self, scale: mx.array, dtype) -> mx.array:
        """Each model row's scale for a layer's slot scales, (rows, 1, 1): gathered once per forward for
        every layer sharing the same scales (``_build_stacks`` interns them)."""
        key = (id(scale), dtype)
        got = self._row_scales.get(key)
        if got is None:
            got = self._row_scales[key] = scale[self.idx].astype(dtype)[:, None, None]
        return got

    # -- residency -----------------------------------------------------------------------------
    def _ensure_resident(self, needed: dict) -> None:
        """Every adapter in ``needed`` (by key: a reloaded adapter is the same slot) gets a slot; the
        slots keep up to ``max_slots`` adapters, those a forward needs first, then the ones held longest."""
        have = [a.key for a in self.slots]
        if all(k in have for k in needed):
            return
        keep = [a for a in self.slots if a.key not in needed]
        fresh = [a for k, a in needed.items() if k not in have]
        kept_needed = [a for a in self.slots if a.key in needed]
        self.slots = kept_needed + keep[: max(0, self.max_slots - len(needed))] + fresh
        self._wrap({p for a in self.slots for p in a.layers})
        self._build_stacks()

    def _wrap(self, paths: set[str]) -> None:
        new = []
        modules = dict(self.model.named_modules())
        for path in sorted(paths - set(self.wrappers)):
            wrapper = MultiLoRALinear(modules[path], path, self)
            self.wrappers[path] = wrapper
            new.append((path, wrapper))
        if new:
            self.model.update_modules(tree_unflatten(new))

    def _build_stacks(self) -> None:
        self.rebuilds += 1
        self.stacks = {}
        scales_of: dict[tuple, mx.array] = {}  # layers with the same slot scales share one array
        for path, wrapper in self.wrappers.items():
            used = [a.layers.get(path) for a in self.slots]  # per slot: this layer's update, or None
            present = [w for w in used if w is not None]
            if not present:
                continue
            n_in, n_out = present[0].a.shape[0], present[0].b.shape[1]
            rank = max(w.a.shape[1] for w in present)  # smaller ranks padded with zeros: exact
            dtype = mx.float32 if any(mx.float32 in (w.a.dtype, w.b.dtype) for w in present) else present[0].a.dtype
            a_rows = [mx.zeros((n_in, rank), dtype)]
            b_rows = [mx.zeros((rank, n_out), dtype)]
            scales = [0.0]
            for w in used:
                r = w.a.shape[1] if w is not None else 0
                a_rows.append(mx.pad(w.a.astype(dtype), [(0, 0), (0, rank - r)]) if w is not None
                              else mx.zeros((n_in, rank), dtype))
                b_rows.append(mx.pad(w.b.astype(dtype), [(0, rank - r), (0, 0)]) if w is not None
                              else mx.zeros((rank, n_out), dtype))
                scales.append(w.scale if w is not None else 0.0)
            gain = None
            if any(a.kind == "dora" and path in a.layers for a in self.slots):
                ones = mx.ones((n_out,), mx.float32)
                gain = mx.stack([ones] + [_dora_gain(a, path, wrapper.base) if a.kind == "dora" and path in a.layers
                                          else ones for a in self.slots])
            scale = scales_of.setdefault(tuple(scales), mx.array(scales, mx.float32))
            self.stacks[path] = (mx.stack(a_rows), mx.stack(b_rows), scale, gain)
        arrays = list({id(x): x for s in self.stacks.values() for x in s if x is not None}.values())
        mx.eval(arrays)
        self.stack_bytes = sum(x.nbytes for x in arrays)

    def stats(self) -> dict:
        return {"resident": [a.name for a in self.slots], "stack_bytes": self.stack_bytes,
                "wrapped_layers": len(self.wrappers), "rebuilds": self.rebuilds}


def _dora_gain(adapter: LoRAAdapter, path: str, base: nn.Module) -> mx.array:
    """m / ||W + scale B^T A^T|| per output (mlx-lm's ``DoRALinear``), computed once per adapter and layer."""
    gain = adapter.gains.get(path)
    if gain is None:
        w = adapter.layers[path]
        weight = base.weight
        if isinstance(base, nn.QuantizedLinear):
            weight = mx.dequantize(weight, base.scales, base.biases, group_size=base.group_size, bits=base.bits,
                                   mode=base.mode)
        adapted = weight + (w.scale * w.b.T) @ w.a.T
        gain = (w.m / mx.linalg.norm(adapted, axis=1)).astype(mx.float32)
        mx.eval(gain)
        adapter.gains[path] = gain
    return gain


def attach(model, max_slots: int) -> LoRARuntime:
    """The model's LoRA runtime (made on first use); wrappers are set as adapters need them."""
    rt = getattr(model, _ATTR, None)
    if rt is None:
        rt = LoRARuntime(model, max_slots)
        object.__setattr__(model, _ATTR, rt)
    return rt


def runtime(model) -> LoRARuntime | None:
    return getattr(model, _ATTR, None)


def adapter_rows(model, seqs, positions: list[int] | None = None):
    """Context for building one forward of ``model`` whose rows are ``seqs`` (``positions``: a ragged
    step's positions per sequence, one model row each). A no-op unless the model has adapters."""
    rt = getattr(model, _ATTR, None)
    if rt is None:
        return contextlib.nullcontext()
    adapters = [getattr(s.request, "adapter", None) for s in seqs]
    if positions is not None:
        adapters = [a for a, n in zip(adapters, positions) for _ in range(n)]
    return rt.bind(adapters)
