"""LoRA adapters on disk: reading mlx-lm's and PEFT's formats, checking them against the base model, and
the registry of named adapters with a bounded number kept loaded (LRU).

Formats (a directory, or an HF repo id: named at start, downloaded on first use like a model; named by a
request, from the local hub cache only):

- **mlx-lm** (what ``mlx_lm.lora`` writes): ``adapter_config.json`` (``fine_tune_type`` ``lora`` or
  ``dora``, ``num_layers``, ``lora_parameters`` {``rank``, ``scale``, ``dropout`` (ignored at inference),
  ``keys``}) and ``adapters.safetensors`` with ``<module path>.lora_a`` (in, r), ``.lora_b`` (r, out) and,
  for DoRA, ``.m`` (out,): the names of the model's own parameters, so the module paths are the model's.
- **PEFT**: ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``) and
  ``adapter_model.safetensors`` with ``base_model.model.<module path>.lora_A.weight`` (r, in) and
  ``.lora_B.weight`` (out, r); scale ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA). The mapping is clear
  where mlx-lm names the model's modules as transformers does (llama, qwen, mistral, gemma, ...); options
  with no plain low-rank mapping (DoRA magnitudes, ``fan_in_fan_out``, per-module rank / alpha patterns,
  trained biases, ``modules_to_save``) are refused.

Every adapter is checked against the base at load: each module path must be a linear layer of the model
and its A / B must have that layer's input / output sizes, else :class:`AdapterLoadError` (an adapter
trained for another base is never run).
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from parallm_engine.errors import AdapterLoadError, AdapterNotFoundError

MLX_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"

#: Adapters kept loaded (beyond those requests in flight hold) unless the engine says otherwise.
DEFAULT_MAX_ADAPTERS = 8


@dataclass(eq=False)
class LayerLoRA:
    """One linear layer's low-rank update: ``y += scale * (x @ a) @ b``; DoRA also rescales by ``m``."""

    a: mx.array  # (in, r)
    b: mx.array  # (r, out)
    scale: float
    m: mx.array | None = None  # DoRA magnitude (out,)


@dataclass(eq=False)
class LoRAAdapter:
    name: str  # what requests call it
    path: Path
    #: The prefix cache's namespace for this adapter's rows: the directory and its weights' mtime, so a
    #: re-trained adapter at the same path never reads KV computed under the old weights.
    key: str
    fmt: str  # "mlx-lm" or "peft"
    kind: str  # "lora" or "dora"
    layers: dict[str, LayerLoRA] = field(repr=False)
    nbytes: int = 0
    #: DoRA: per-layer output gain m / ||W + scale B^T A^T|| (computed on the engine thread: ``lora``).
    gains: dict = field(default_factory=dict, repr=False)


def linear_dims(model) -> dict[str, tuple[int, int]]:
    """(input, output) sizes of every linear layer of ``model`` by module path (as mlx-lm names them)."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            out[path] = (module.weight.shape[1] * 32 // module.bits, module.weight.shape[0])
        elif isinstance(module, nn.Linear):
            out[path] = (module.weight.shape[1], module.weight.shape[0])
    return out


def resolve_adapter_dir(spec: str | os.PathLike, download: bool = False) -> Path:
    """The directory of an adapter given by path or HF repo id: from the hub cache, and with ``download``
    (an adapter named when an engine starts or ``load_adapter``: not a request's field, so a client never
    makes a server download) fetched there on first use as models are (``hub.fetch_adapter``)."""
    from parallm_engine.errors import ModelLoadError, ModelNotFoundError
    from parallm_engine.models.hub import cached_hub_snapshot, fetch_adapter, parse_repo_spec

    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise AdapterLoadError(f"adapter {str(spec)!r} is a file; pass the adapter's directory")
    local = cached_hub_snapshot(str(spec))
    if local is not None and (local / "adapter_config.json").exists():
        return local
    if download and parse_repo_spec(str(spec)) is not None:
        try:
            local = fetch_adapter(str(spec))
        except ModelNotFoundError as exc:
            raise AdapterNotFoundError(f"unknown adapter {str(spec)!r}: {exc}") from exc
        except ModelLoadError as exc:  # offline and not cached, a download that stopped: say so, typed
            raise AdapterLoadError(f"adapter {str(spec)!r}: {exc}") from exc
        if not (local / "adapter_config.json").exists():
            raise AdapterLoadError(f"{spec} has no adapter_config.json: not a LoRA adapter repository")
        return local
    raise AdapterNotFoundError(
        f"unknown adapter {str(spec)!r}: not a registered adapter name, not an adapter directory, and not an "
        "HF repo id in the local Hugging Face cache (name it when the engine starts to download it)"
    )


def load_adapter(name: str, directory: Path, dims: dict[str, tuple[int, int]]) -> LoRAAdapter:
    """Read and check the adapter in ``directory`` against a model whose linear layers are ``dims``."""
    cfg_path = directory / CONFIG
    if not cfg_path.is_file():
        raise AdapterLoadError(f"{directory} has no {CONFIG}: not a LoRA adapter directory")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterLoadError(f"{cfg_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterLoadError(f"{cfg_path} must hold a JSON object")
    if (directory / MLX_WEIGHTS).is_file():
        fmt, weights_file = "mlx-lm", directory / MLX_WEIGHTS
        kind, layers = _read_mlx_lm(config, _load_weights(weights_file), cfg_path)
    elif (directory / PEFT_WEIGHTS).is_file():
        fmt, weights_file = "peft", directory / PEFT_WEIGHTS
        kind, layers = "lora", _read_peft(config, _load_weights(weights_file), cfg_path)
    else:
        raise AdapterLoadError(f"{directory} has neither {MLX_WEIGHTS} (mlx-lm) nor {PEFT_WEIGHTS} (PEFT)")
    if not layers:
        raise AdapterLoadError(f"{weights_file} holds no LoRA weights")
    _check_against_base(layers, dims, directory)
    nbytes = sum(w.a.nbytes + w.b.nbytes + (w.m.nbytes if w.m is not None else 0) for w in layers.values())
    key = f"{directory}@{weights_file.stat().st_mtime_ns}"
    return LoRAAdapter(name, directory, key, fmt, kind, layers, nbytes)


def _load_weights(path: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except Exception as exc:  # noqa: BLE001 - a corrupt file is the caller's input
        raise AdapterLoadError(f"could not read {path}: {exc}") from exc


def _read_mlx_lm(config: dict, weights: dict, where: Path) -> tuple[str, dict[str, LayerLoRA]]:
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterLoadError(f"{where}: fine_tune_type {kind!r} is not an adapter (lora or dora)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or "scale" not in params or "rank" not in params:
        raise AdapterLoadError(f"{where}: lora_parameters must give rank and scale (mlx-lm's adapter_config.json)")
    scale = float(params["scale"])
    parts: dict[str, dict[str, mx.array]] = {}
    for name, w in weights.items():
        path, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b", "m"):
            raise AdapterLoadError(f"{where}: {name} is not a LoRA weight (lora_a, lora_b or m)")
        parts.setdefault(path, {})[leaf] = w
    layers = {}
    for path, p in parts.items():
        if "lora_a" not in p or "lora_b" not in p or (kind == "dora") != ("m" in p):
            raise AdapterLoadError(f"{where}: {path} needs lora_a and lora_b" + (" and m (DoRA)" if kind == "dora" else ""))
        if p["lora_a"].shape[1] != int(params["rank"]):
            raise AdapterLoadError(f"{where}: {path}.lora_a has rank {p['lora_a'].shape[1]}, the config says "
                                   f"{params['rank']}")
        layers[path] = LayerLoRA(p["lora_a"], p["lora_b"], scale, p.get("m"))
    return kind, layers


_PEFT_PREFIX = "base_model.model."


def _read_peft(config: dict, weights: dict, where: Path) -> dict[str, LayerLoRA]:
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterLoadError(f"{where}: peft_type {config.get('peft_type')!r} is not LoRA")
    refused = [k for k in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "modules_to_save",
                           "layers_to_transform") if config.get(k)]
    if config.get("bias", "none") != "none":
        refused.append("bias")
    if refused:
        raise AdapterLoadError(f"{where}: PEFT options with no plain low-rank mapping: {', '.join(refused)}")
    try:
        r, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterLoadError(f"{where}: PEFT adapter_config.json needs r and lora_alpha") from exc
    scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
    parts: dict[str, dict[str, mx.array]] = {}
    for name, w in weights.items():
        if not name.startswith(_PEFT_PREFIX):
            raise AdapterLoadError(f"{where}: {name} is not a PEFT LoRA weight (base_model.model.*)")
        stem = name[len(_PEFT_PREFIX):].replace(".default.", ".")
        for leaf in ("lora_A", "lora_B"):
            if stem.endswith(f".{leaf}.weight"):
                parts.setdefault(stem[: -len(f".{leaf}.weight")], {})[leaf] = w
                break
        else:
            raise AdapterLoadError(f"{where}: {name} is not a lora_A / lora_B weight")
    layers = {}
    for path, p in parts.items():
        if "lora_A" not in p or "lora_B" not in p:
            raise AdapterLoadError(f"{where}: {path} needs both lora_A and lora_B")
        layers[path] = LayerLoRA(p["lora_A"].T, p["lora_B"].T, scale)
    return layers


def _check_against_base(layers: dict[str, LayerLoRA], dims: dict[str, tuple[int, int]], where: Path) -> None:
    errors = []
    for path, w in layers.items():
        if path not in dims:
            errors.append(f"{path}: not a linear layer of this model")
            continue
        n_in, n_out = dims[path]
        if w.a.ndim != 2 or w.b.ndim != 2 or w.a.shape[0] != n_in or w.b.shape[1] != n_out or w.a.shape[1] != w.b.shape[0]:
            errors.append(f"{path}: A {tuple(w.a.shape)} / B {tuple(w.b.shape)} do not fit the model's layer "
                          f"({n_in} in, {n_out} out)")
        elif w.m is not None and tuple(w.m.shape) != (n_out,):
            errors.append(f"{path}: DoRA magnitude {tuple(w.m.shape)} does not fit {n_out} outputs")
    if errors:
        shown = "\n  ".join(errors[:8]) + (f"\n  ... {len(errors) - 8} more" if len(errors) > 8 else "")
        raise AdapterLoadError(f"adapter {where} does not fit this model (trained for another base?):\n  {shown}")


class AdapterRegistry:
    """Named adapters and the loaded ones (thread-safe: callers resolve on their own threads).

    ``max_loaded`` adapters stay loaded, least recently used dropped first; an adapter a request in
    flight uses stays alive with that request (the engine's batch holds it) and is loaded again on its
    next use once dropped."""

    def __init__(self, dims: dict[str, tuple[int, int]], max_loaded: int = DEFAULT_MAX_ADAPTERS):
        if isinstance(max_loaded, bool) or not isinstance(max_loaded, int) or max_loaded < 1:
            raise AdapterLoadError(f"max_adapters must be a positive integer, got {max_loaded!r}", param="max_adapters")
        self.dims = dims
        self.max_loaded = max_loaded
        self.named: dict[str, Path] = {}
        self.loaded: OrderedDict[tuple[str, Path], LoRAAdapter] = OrderedDict()
        self.loads = 0
        self.evictions = 0
        self._lock = threading.Lock()

    def register(self, name: str, spec: str | os.PathLike, load: bool = True) -> LoRAAdapter | None:
        """Name the adapter at ``spec`` (a directory or HF repo id, downloaded on first use); ``load``: read
        and check it now."""
        if not isinstance(name, str) or not name or "=" in name:
            raise AdapterLoadError(f"adapter name must be a non-empty string without '=', got {name!r}")
        directory = resolve_adapter_dir(spec, download=True)
        adapter = self._load(name, directory) if load else None
        with self._lock:
            self.named[name] = directory
        return adapter

    def resolve(self, name_or_path: str | os.PathLike) -> LoRAAdapter:
        """The loaded adapter a request names: a registered name, else a directory / cached repo id."""
        if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path):
            raise AdapterLoadError(f"adapter must be a name or a path, got {name_or_path!r}")
        key = str(name_or_path)
        with self._lock:
            directory = self.named.get(key)
        if directory is None:
            directory = resolve_adapter_dir(name_or_path)
        return self._load(key, directory)

    def _load(self, name: str, directory: Path) -> LoRAAdapter:
        key = (name, directory)
        with self._lock:
            adapter = self.loaded.get(key)
            if adapter is not None:
                self.loaded.move_to_end(key)
                return adapter
        adapter = load_adapter(name, directory, self.dims)  # outside the lock: other names keep resolving
        mx.eval([a for w in adapter.layers.values() for a in (w.a, w.b, w.m) if a is not None])
        with self._lock:
            adapter = self.loaded.setdefault(key, adapter)
            self.loaded.move_to_end(key)
            self.loads += 1
            while len(self.loaded) > self.max_loaded:
                self.loaded.popitem(last=False)
                self.evictions += 1
        return adapter

    def names(self) -> list[str]:
        with self._lock:
            return list(self.named)

    def stats(self) -> dict:
        with self._lock:
            loaded = list(self.loaded.values())
            return {
                "registered": list(self.named),
                "loaded": [a.name for a in loaded],
                "max_loaded": self.max_loaded,
                "loaded_bytes": sum(a.nbytes for a in loaded),
                "loads": self.loads,
                "evictions": self.evictions,
            }
