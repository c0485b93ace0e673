"""Convert a GGUF file (what Ollama / LM Studio users already have) into an HF-layout model directory that
mlx-lm loads, cached on disk so later starts skip the conversion.

Architectures: llama (and Mistral, SmolLM: llama in GGUF), qwen2, qwen3, gemma3, phi3
(:mod:`.gguf_families` holds what differs per family); any other raises
:class:`~parallm_engine.errors.UnsupportedGGUFArchitectureError`. Tensors come from :mod:`.gguf_reader`
(Q4_0/Q4_1/Q8_0/Q4_K stay MLX-quantized, group 32; other quantized types are dequantized), GGUF names are mapped to
mlx-lm's, llama.cpp's changes are undone (llama Q/K row permutation: quantization groups run along columns,
so packed weight, scales and biases are permuted by row together; Gemma's ``+1`` on norm weights),
``config.json`` is written from the metadata and the tokenizer rebuilt from it (:mod:`.gguf_tokenizer`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from parallm_engine import settings
from parallm_engine.errors import ModelLoadError
from parallm_engine.models.gguf_families import FAMILIES, TOP_NAMES, Meta, family_for, llama3_rope_scaling
from parallm_engine.models.gguf_reader import load_gguf_tensors, read_gguf_header
from parallm_engine.models.gguf_tokenizer import CHATML_TOOLS_TEMPLATE, write_gguf_tokenizer

__all__ = [
    "CHATML_TOOLS_TEMPLATE", "converted_dir_for", "default_cache_dir", "ensure_converted", "gguf_sampling_defaults",
    "read_gguf_metadata", "convert_gguf", "gguf_architecture",
]

_CONVERTER_VERSION = "5"  # bump when the converted layout changes, to invalidate caches


def default_cache_dir() -> Path:
    root = settings.cache_dir()
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "parallm" if xdg else Path.home() / ".cache" / "parallm"


def _file_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}|{_CONVERTER_VERSION}".encode())
    return h.hexdigest()[:16]


def converted_dir_for(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    cache_dir = cache_dir or default_cache_dir()
    return cache_dir / "models" / f"{gguf_path.stem}-{_file_key(gguf_path)}"


def ensure_converted(gguf_path: str | os.PathLike, cache_dir: Path | None = None) -> Path:
    """Return an mlx-lm loadable directory for ``gguf_path``, converting it once if needed."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    out = converted_dir_for(gguf_path, cache_dir)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename: concurrent processes never see half a model.
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        convert_gguf(gguf_path, tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process won the race
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_gguf_metadata(gguf_path: str | os.PathLike, want=lambda key: True) -> dict:
    """The scalar and string metadata of a GGUF file whose keys ``want`` accepts (arrays are skipped).

    Pure Python over the header only (no mlx, no tensors), so it is cheap enough to call at construction
    time. Raises :class:`ModelLoadError` for a file that is not GGUF."""
    return read_gguf_header(gguf_path, want)[0]


def gguf_architecture(gguf_path: str | os.PathLike) -> tuple[str | None, bool]:
    """``(general.architecture, whether the GGUF loader converts it)``, from the header only (cheap: for
    listings such as ``parallm models``). Raises :class:`ModelLoadError` for a file that is not GGUF."""
    arch = read_gguf_metadata(gguf_path, want=lambda key: key == "general.architecture").get("general.architecture")
    return arch, arch in FAMILIES


#: llama.cpp's ``general.sampling.*`` metadata keys (written by convert_hf_to_gguf from the model's
#: generation_config.json) -> ParaLLM's sampling names; the later spellings are other tools'.
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.temperature": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
    "general.sampling.repeat_penalty": "repetition_penalty",
    "general.sampling.repetition_penalty": "repetition_penalty",
}


def gguf_sampling_defaults(gguf_path: str | os.PathLike) -> dict:
    """The sampling settings a GGUF file recommends in its metadata (empty if it has none)."""
    meta = read_gguf_metadata(gguf_path, want=lambda key: key in GGUF_SAMPLING_KEYS)
    # Floats are stored as float32: 0.2 reads back as 0.20000000298..., so round to float32 precision.
    return {GGUF_SAMPLING_KEYS[k]: round(v, 6) if isinstance(v, float) else v for k, v in meta.items()}


def _unpermute_rows(x, n_head: int):
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `permute`)."""
    rows = x.shape[0]
    rest = x.shape[1:]
    # llama.cpp wrote reshape(H, 2, D/2).swapaxes(1, 2); the inverse reads it as (H, D/2, 2).
    return x.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer files of ``gguf_path`` into ``out_dir``."""
    import mlx.core as mx

    meta, infos = read_gguf_header(gguf_path, arrays=True, tensors=True)
    arch = meta.get("general.architecture")
    family = family_for(arch, gguf_path)  # typed error for an architecture not supported
    m = Meta(meta, arch)
    try:
        config = family.config(m)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{gguf_path}: GGUF metadata incomplete for {arch}: missing or bad {exc}") from exc
    weights = load_gguf_tensors(gguf_path, infos)

    out_w: dict = {}
    quant: dict = {}
    rope_factors: dict = {}
    for name, arr in weights.items():
        base, _, suffix = name.rpartition(".")  # suffix: weight / bias, or mx.load's scales / biases
        parts = base.split(".")
        if base in ("rope_freqs", "rope_factors_long", "rope_factors_short"):  # per-dimension RoPE factors
            rope_factors[base] = [float(v) for v in arr.astype(mx.float32).tolist()]
            continue
        if parts[0] == "blk" and len(parts) >= 3 and ".".join(parts[2:]) in family.layer_names:
            key = ".".join(parts[2:])
            hf = f"model.layers.{int(parts[1])}.{family.layer_names[key]}"
            if family.permuted_qk and key in ("attn_q", "attn_k"):
                heads = config["num_attention_heads"] if key == "attn_q" else config["num_key_value_heads"]
                arr = _unpermute_rows(arr, heads)
        elif base in TOP_NAMES:
            hf = TOP_NAMES[base]
        elif "_exps" in base:  # expert tensors: a Mixtral-style MoE stored under a dense architecture name
            raise ModelLoadError(f"{gguf_path}: mixture-of-experts {arch!r} GGUF files are not supported ({name})")
        else:
            raise ModelLoadError(f"{gguf_path}: unexpected tensor {name} for GGUF architecture {arch!r}")
        if family.norm_shift and base.endswith("norm") and suffix == "weight":
            arr = (arr.astype(mx.float32) - family.norm_shift).astype(arr.dtype)
        out_w[f"{hf}.{suffix}"] = arr
        if suffix == "scales":
            packed = weights[f"{base}.weight"]
            bits = packed.shape[-1] * 32 // (arr.shape[-1] * 32)  # 32-value groups
            quant[hf] = {"group_size": 32, "bits": int(bits), "mode": "affine"}
    if "rope_freqs" in rope_factors and arch == "llama":  # Llama 3.1+: llama3 scaling, kept as its factors
        try:
            scaling = llama3_rope_scaling(rope_factors["rope_freqs"], config["head_dim"], config["rope_theta"])
        except ValueError as exc:
            raise ModelLoadError(f"{gguf_path}: {exc}") from exc
        if scaling:
            config["rope_scaling"] = scaling
    elif "rope_factors_long" in rope_factors and arch == "phi3":  # Phi-3 / 3.5 LongRoPE
        long = rope_factors["rope_factors_long"]
        config["rope_scaling"] = {"type": "longrope", "long_factor": long,
                                  "short_factor": rope_factors.get("rope_factors_short", long)}
    elif rope_factors:
        raise ModelLoadError(f"{gguf_path}: RoPE factor tensors {sorted(rope_factors)} not supported for {arch!r}")

    tokens = meta.get("tokenizer.ggml.tokens") or []
    config.update(
        model_type=family.model_type,
        architectures=[family.architectures],
        vocab_size=int(m.get("vocab_size", len(tokens) or out_w["model.embed_tokens.weight"].shape[0])),
        tie_word_embeddings="lm_head.weight" not in out_w,  # llama.cpp drops a tied output.weight
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        torch_dtype="float16",
        gguf_source={"file": str(gguf_path), "architecture": arch, "name": meta.get("general.name"),
                     "license": meta.get("general.license")},
    )
    if quant:
        # mlx-lm reads per-layer overrides keyed by module path; the common setting is the default.
        common = max(quant.values(), key=lambda q: sum(v == q for v in quant.values()))
        qcfg = dict(common)
        for path, q in quant.items():
            if q != common:
                qcfg[path] = q
        # Layers not quantized in the file (norms, dequantized K-quants) are skipped by mlx-lm because
        # they have no `.scales`.
        config["quantization"] = qcfg
        config["quantization_config"] = qcfg

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), out_w, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    write_gguf_tokenizer(meta, arch, out_dir, config["max_position_embeddings"])
