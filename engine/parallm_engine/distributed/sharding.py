"""Split a loaded (still lazy) model over the ranks, by the model's own code where it has it.

- ``tensor``: mlx-lm's ``Model.shard(group)`` (attention heads and MLP columns over the ranks, an ``all_sum``
  after each block's output projection). Families without it are refused.
- ``pipeline``: mlx-lm's own ``model.pipeline(group, split)`` where the family has it (qwen2, qwen3-moe,
  deepseek, glm4-moe, ...: rank 0 keeps the *last* layers, as mlx-lm orders them); for every other model
  whose layers are a list, a layer-range pipeline of the same shape: rank r keeps a contiguous range of
  layers (rank 0 the first), its first layer takes its input from rank r - 1 (``recv_like``) and its last
  sends its output on (``send``). Either way the last stage's hidden state then reaches every rank
  (``all_gather``), so the final norm and head run everywhere and every rank samples from the same logits.
  mlx-lm's forward ties its send to ``cache[-1].keys``: the engine's caches take that assignment
  (``kv/pipeline_tie.py``); its forwards evaluate their outputs, which hold the send already.

Only what a rank keeps is ever read from the weight files: the model is loaded lazily and the layers a rank
does not own are dropped before its parameters are evaluated (as mlx-lm's ``sharded_load``). A pipeline
rank also downloads only the weight files that hold its layers (``ShardPlan.weight_files``: the checkpoint
index's ``weight_map`` by layer number), so a model named by HF id is never whole on any machine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from parallm_engine.errors import DistributedError, ModelLoadError

INDEX = "model.safetensors.index.json"
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a weight of layer N (mlx-lm's sharded_load matches the same)


def _inner(net):
    """The module whose ``layers`` list the model's forward loops over (mlx-lm: ``Model.model``)."""
    for holder in (getattr(net, "model", None), getattr(net, "language_model", None), net):
        layers = getattr(holder, "layers", None) if holder is not None else None
        if isinstance(layers, list) and layers:
            return holder
    return None


def supported_modes(net) -> list[str]:
    modes = []
    if _inner(net) is not None:
        modes.append("pipeline")
    if callable(getattr(net, "shard", None)):
        modes.append("tensor")
    return modes


def layer_split(n_layers: int, capacities: list[int]) -> list[int]:
    """Layers per rank in proportion to what each rank can hold (``capacities``: bytes for weights and KV),
    each at least one; capacities within 10% of each other give an even split (the low ranks take the
    remainder): what a process sees free moves a little between two readings."""
    size = len(capacities)
    if n_layers < size:
        raise DistributedError(f"a {n_layers}-layer model cannot be split over {size} ranks")
    total = sum(capacities)
    if min(capacities) <= 0 or max(capacities) < 1.1 * min(capacities):  # alike (or unknown): even
        base, extra = divmod(n_layers, size)
        return [base + (1 if r < extra else 0) for r in range(size)]
    raw = [n_layers * c / total for c in capacities]
    split = [max(1, int(x)) for x in raw]
    while sum(split) < n_layers:  # the largest remainders get the layers left
        r = max(range(size), key=lambda i: raw[i] - split[i])
        split[r] += 1
    while sum(split) > n_layers:
        r = max((i for i in range(size) if split[i] > 1), key=lambda i: split[i] - raw[i])
        split[r] -= 1
    return split


class StageOutputs:
    """What a pipeline stage computed for each forward, before the hidden state is gathered: while
    ``recording`` (``runner/forward.micro_batched``), the stage's last layer adds its output (after the send,
    where it sends) for each forward built. Evaluating these for every micro-batch before any gather lets a
    rank compute its next micro-batch while the next rank computes its last one."""

    def __init__(self):
        self.recording = False
        self.items: list = []  # the current forward's
        self.forwards: list = []  # (output, what to evaluate first) per forward built while recording
        self.most = 0  # the most forwards one recording held (micro-batches that ran in one step)


class _Stage(nn.Module):
    """A layer at a pipeline stage's edge: its input comes from the previous rank (``recv_from``), and/or its
    output goes to the next (``send_to``) and the last rank's output is then taken on every rank
    (``gather``); ``outputs``: the stage's :class:`StageOutputs` (its last layer records there). Everything
    else about the layer (``self_attn``, ``use_sliding``, ...) reads through."""

    def __init__(self, layer, group, rank: int, size: int, recv_from: int | None, send_to: int | None, gather: bool,
                 outputs: StageOutputs | None = None):
        super().__init__()
        self.layer = layer
        # plain attributes, not child modules (a tuple would join the parameter tree)
        object.__setattr__(self, "_edge", (group, rank, size, recv_from, send_to, gather))
        object.__setattr__(self, "_outputs", outputs)

    def __getattr__(self, key):
        if key in self:
            return self[key]
        if key.startswith("__") or "layer" not in self:
            raise AttributeError(key)
        return getattr(self["layer"], key)

    def __call__(self, x, *args, **kwargs):
        group, rank, size, recv_from, send_to, gather = self._edge
        if recv_from is not None:
            x = mx.distributed.recv_like(x, recv_from, group=group)
        h = self.layer(x, *args, **kwargs)
        if send_to is not None:
            h = mx.distributed.send(h, send_to, group=group)
            _after_send(args, kwargs, h)
        if self._outputs is not None and self._outputs.recording:
            self._outputs.items.append(h)
        if gather:  # the last rank's hidden state, on every rank
            B = h.shape[0]
            h = mx.distributed.all_gather(h, group=group)[(size - 1) * B : size * B]
        return h


def _after_send(args, kwargs, sent) -> None:
    """mlx-lm's own generation evaluates only the caches after a prefill chunk: an mlx-lm cache of the
    stage's last layer is made to depend on the send (as mlx-lm's pipeline does), so the activations leave
    even then. The engine's caches need nothing: its forwards evaluate their outputs (``runner/forward``)."""
    cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
    if type(cache).__module__.startswith("mlx_lm") and isinstance(getattr(cache, "keys", None), mx.array):
        cache.keys = mx.depends(cache.keys, sent)


def layer_range(net, rank: int, split: list[int]) -> tuple[int, int]:
    """The layers [start, end) rank ``rank`` keeps under ``split``: mlx-lm's own pipeline gives rank 0 the
    last layers, the engine's layer-range split the first."""
    if callable(getattr(_inner(net), "pipeline", None)):
        start = sum(split[rank + 1 :])
    else:
        start = sum(split[:rank])
    return start, start + split[rank]


class ShardPlan:
    """This rank's split, decided before any weight is read or downloaded: every rank's memory is gathered
    once, when the plan is made (a collective: every rank makes its plan at the same point of the load,
    whatever its local cache holds). Called on the lazily loaded model, it splits it; ``weight_files(path)``
    is what a pipeline rank downloads."""

    def __init__(self, dist, memory_bytes: int | None):
        self.dist = dist
        self.capacities = [row[0] for row in dist.gather_ints([int(memory_bytes or 0)])]

    def __call__(self, net) -> None:
        self.dist.shard.update(shard_model(net, self.dist, self.capacities))

    def weight_files(self, path: Path) -> list[str] | None:
        """The weight files (as the index names them) that hold this rank's layers, plus every file with
        weights outside the layers (embedding, final norm, head); None: every file (tensor parallel needs
        each layer, a checkpoint without an index is one file)."""
        index = Path(path) / INDEX
        if self.dist.mode != "pipeline" or not index.exists():
            return None
        from mlx_lm.utils import load_model as mlx_load_model

        net, _ = mlx_load_model(Path(path), lazy=True, strict=False)  # the family's classes; no weight is read
        inner = _inner(net)
        if inner is None:
            return None  # shard_model refuses it, naming the modes it supports
        n = len(inner.layers)
        start, end = layer_range(net, self.dist.rank, layer_split(n, self.capacities))
        files, indexed = _files_for(json.loads(index.read_text())["weight_map"], start, end)
        missing = sorted(set(range(n)) - indexed)
        if missing:
            raise ModelLoadError(f"{path}: the checkpoint has no weights for layers {missing[:8]}"
                                 f"{' ...' if len(missing) > 8 else ''} (convert it with mlx_lm.convert first)")
        return sorted(files)

    def check_files(self, path: Path) -> None:
        """After a partial download: every file this rank's layers need is there (mlx-lm loads a partial
        checkpoint non-strictly, so a missing one would leave random weights)."""
        start, end = self.dist.shard["layers"]
        files, _ = _files_for(json.loads((Path(path) / INDEX).read_text())["weight_map"], start, end)
        absent = sorted(f for f in files if not (Path(path) / f).exists())
        if absent:
            raise ModelLoadError(f"{path}: rank {self.dist.rank} needs {', '.join(absent)} for layers "
                                 f"{start}-{end - 1}, and they are not there")


def _files_for(weight_map: dict, start: int, end: int) -> tuple[set[str], set[int]]:
    """(the files holding layers [start, end) or weights outside any layer, every layer number indexed)."""
    files, indexed = set(), set()
    for key, f in weight_map.items():
        m = _LAYER_KEY.search(key)
        if m is None:
            files.add(f)  # every stage keeps the embedding, the final norm and the head
            continue
        indexed.add(int(m.group(1)))
        if start <= int(m.group(1)) < end:
            files.add(f)
    return files, indexed


def _layer_range(net, group, split: list[int]) -> tuple[int, int]:
    inner = _inner(net)
    rank, size = group.rank(), group.size()
    start, end = layer_range(net, rank, split)
    mine = list(inner.layers[start:end])
    first, last = 0, len(mine) - 1
    staged = []
    for i, layer in enumerate(mine):
        recv_from = rank - 1 if i == first and rank > 0 else None
        send_to = rank + 1 if i == last and rank < size - 1 else None
        gather = i == last
        staged.append(_Stage(layer, group, rank, size, recv_from, send_to, gather,
                             net.stage_outputs if gather else None)
                      if recv_from is not None or send_to is not None or gather else layer)
    inner.layers = staged
    return start, end


def shard_model(net, dist, capacities: list[int] | None = None) -> dict:
    """Split ``net`` for ``dist`` (a ``DistributedGroup``) in place; what this rank holds, for ``info``.
    ``capacities``: each rank's memory for weights and KV (a pipeline gives a rank layers in proportion; every
    layer costs its weights and the KV it will hold, alike)."""
    modes = supported_modes(net)
    name = type(net).__module__.rsplit(".", 1)[-1]
    if dist.mode not in modes:
        raise DistributedError(
            f"the {name} family cannot run distributed={dist.mode!r}; it supports: {', '.join(modes) or 'none'}",
            supported=modes)
    inner = _inner(net)
    n_layers = len(inner.layers)
    if dist.mode == "tensor":
        _check_heads(net, dist.size)
        net.shard(dist.group)
        return {"layers": [0, n_layers], "num_layers": n_layers, "sharding": "mlx-lm shard()"}
    split = layer_split(n_layers, capacities or [1] * dist.size)
    net.stage_outputs = StageOutputs()
    if callable(getattr(inner, "pipeline", None)):
        start, end = _own_pipeline(net, inner, dist.group, split)
        # rank 0 holds the last layers: activations flow from rank size - 1 down to rank 0
        rank, size = dist.rank, dist.size
        return {"layers": [start, end], "num_layers": n_layers, "sharding": "mlx-lm pipeline()",
                "recv_from": rank + 1 if rank < size - 1 else None, "send_to": rank - 1 if rank > 0 else None}
    start, end = _layer_range(net, dist.group, split)
    rank, size = dist.rank, dist.size
    return {"layers": [start, end], "num_layers": n_layers, "sharding": "layer range",
            "recv_from": rank - 1 if rank > 0 else None, "send_to": rank + 1 if rank < size - 1 else None}


def _own_pipeline(net, inner, group, split: list[int]) -> tuple[int, int]:
    """mlx-lm's ``pipeline(group, split)``: ``split[r]`` layers for rank r, the last layers on rank 0. The
    engine then sees only the rank's layers through ``net.layers`` (its caches, its KV bytes per token)."""
    if group.size() != mx.distributed.init().size():
        # its sends and all_gather use MLX's default group
        raise DistributedError("mlx-lm's pipeline runs on the whole launched group only")
    inner.pipeline(group, split=split)
    start, end = inner.start_idx, inner.end_idx
    assert (start, end) == layer_range(net, group.rank(), split)  # what weight_files chose to download
    # its last layer records the stage's output (mlx-lm's forward sends it on and ties the send to the
    # stage's last cache, which ``runner/forward.micro_batched`` evaluates with it)
    inner.layers[end - 1] = _Stage(inner.layers[end - 1], group, group.rank(), group.size(), None, None, False,
                                   net.stage_outputs)
    mine = list(net.layers)
    if len(mine) != end - start or any(layer is None for layer in mine):
        raise DistributedError(f"the {type(net).__module__.rsplit('.', 1)[-1]} family's layers do not follow "
                               "its pipeline split", supported=["tensor"] if callable(getattr(net, "shard", None))
                               else [])
    return start, end


def _check_heads(net, size: int) -> None:
    """Tensor parallel splits the attention heads: both head counts must divide by the ranks."""
    args = getattr(net, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    kv = getattr(args, "num_key_value_heads", None) or heads
    for what, n in (("attention heads", heads), ("key/value heads", kv)):
        if isinstance(n, int) and n % size:
            raise DistributedError(f"tensor parallel over {size} ranks needs {what} divisible by {size}; the model "
                                   f"has {n}: use distributed='pipeline'", supported=["pipeline"])
