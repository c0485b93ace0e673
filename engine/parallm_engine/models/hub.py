"""Models by name: ``org/name`` or ``org/name@revision`` from the Hugging Face hub, downloaded on first use
into the user's hub cache the way mlx-lm does it (``snapshot_download`` with the same allow-patterns, so a
model mlx-lm downloaded opens here offline and the other way round), then opened from the cache offline.

Two steps: ``config.json`` first (a few KB), to refuse an architecture neither mlx-lm nor mlx-vlm runs
before any weights move; then the snapshot with the patterns that kind of model needs. huggingface_hub
writes every file to ``*.incomplete`` and moves it into place whole, and records the repo's file list, so a
snapshot missing a file is refused (``IncompleteSnapshotError``) instead of handed to the loader; running
the same call again finishes the download (files that arrived whole are kept). ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, ``HF_HOME`` /
``HF_HUB_CACHE`` and ``HF_TOKEN`` are read when a model is fetched (huggingface_hub reads some of them
once, at import), and its errors become ParaLLM's typed ones (``errors.py``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from parallm_engine.errors import (
    GatedModelError,
    ModelDownloadError,
    ModelLoadError,
    ModelNotCachedError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)

#: What mlx-lm downloads for a text model (``mlx_lm.utils.DEFAULT_ALLOW_PATTERNS``; a test checks they agree):
#: config / generation config / tokenizer / safetensors index (*.json), the weights, tokenizer models, chat
#: templates. The same list both times matters: reopening with other patterns than the download used makes
#: huggingface_hub raise IncompleteSnapshotError (or fetch files mlx-lm never needed).
TEXT_ALLOW_PATTERNS = [
    "*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt",
    "*.jsonl", "*.jinja",
]
#: What mlx-vlm downloads for a vision-language model (``mlx_vlm.utils.get_model_path``): its processor
#: configs are *.json too; its weights are not always named model*.
VISION_ALLOW_PATTERNS = ["*.json", "*.jsonl", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]

#: Encoder embedding families (mlx-embeddings runs them, not mlx-lm): fetched only where an encoder is wanted.
ENCODER_TYPES = ("bert", "xlm-roberta", "xlm_roberta", "modernbert")
#: A LoRA adapter repo's files (mlx-lm's adapters.safetensors or PEFT's adapter_model.safetensors + config).
ADAPTER_ALLOW_PATTERNS = ["*.json", "*.safetensors"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


def parse_repo_spec(spec: str | os.PathLike | None) -> tuple[str, str | None] | None:
    """``("org/name", revision or None)`` when ``spec`` reads as a hub repo id (``org/name``,
    ``org/name@revision``), else None. A path that exists on disk is never a repo id."""
    if not isinstance(spec, str) or Path(spec).expanduser().exists():
        return None
    repo_id, at, revision = spec.partition("@")
    if not _REPO_ID.match(repo_id) or ".." in repo_id or (at and not revision):
        return None
    return repo_id, revision or None


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def offline_mode() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now, or as huggingface_hub read it at import."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def hub_cache_dir() -> Path:
    """The hub cache as the environment says now: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    huggingface_hub's own default."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def _hub_kwargs(local_only: bool) -> dict:
    return {
        "cache_dir": str(hub_cache_dir()),
        "endpoint": os.environ.get("HF_ENDPOINT", "").rstrip("/") or None,
        "local_files_only": local_only or offline_mode(),
    }


def allow_patterns_for(config: dict) -> list[str]:
    """The files a model of this config needs (vision-language models: mlx-vlm's list)."""
    return VISION_ALLOW_PATTERNS if "vision_config" in config else TEXT_ALLOW_PATTERNS


def runnable_by(config: dict) -> str | None:
    """``"mlx-lm"`` or ``"mlx-vlm"`` when that library has a model class for this config, else None."""
    import importlib

    if "vision_config" in config:
        try:
            from mlx_vlm.utils import get_model_and_args

            get_model_and_args(config)
            return "mlx-vlm"
        except Exception:  # noqa: BLE001  (not installed, or no such family: try mlx-lm's text model)
            pass
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    try:
        from mlx_lm.utils import _get_classes  # mlx-lm's own lookup (remappings included)

        _get_classes(config)
        return "mlx-lm"
    except (ImportError, ValueError, KeyError):
        pass
    try:  # a model type only mlx-vlm knows, without a vision tower in this checkpoint
        importlib.import_module(f"mlx_vlm.models.{model_type}")
        return "mlx-vlm"
    except ImportError:
        return None


def architecture_of(config: dict) -> str:
    """``model_type`` and the architectures list, as a person reads them (for messages and tables)."""
    arch = config.get("architectures") or []
    arch = [arch] if isinstance(arch, str) else list(arch)
    model_type = config.get("model_type") or "no model_type"
    return f"{model_type} ({', '.join(arch)})" if arch else str(model_type)


def check_architecture(config: dict, where: str) -> str:
    """Which library runs ``config``'s model; :class:`UnsupportedArchitectureError` naming it otherwise."""
    refuse_encoder(config, where)
    runner = runnable_by(config)
    if runner is None:
        raise UnsupportedArchitectureError(
            f"{where} is a {architecture_of(config)} model, which neither mlx-lm nor mlx-vlm can run "
            "(upgrade them if it is new: pip install -U mlx-lm mlx-vlm)",
            architecture=config.get("model_type"),
        )
    return runner


def refuse_encoder(config: dict, where) -> None:
    """:class:`UnsupportedArchitectureError` for an encoder embedding model asked to generate (it embeds)."""
    if config.get("model_type") in ENCODER_TYPES:
        raise UnsupportedArchitectureError(
            f"{where} is a {architecture_of(config)} encoder embedding model: it embeds, it does not generate "
            "(ParaLLMEmbeddings / get_embedding_engine / parallm serve --embedding-model run it with "
            "mlx-embeddings)", architecture=config.get("model_type"))


def _repo(spec: str) -> tuple[str, str | None]:
    parsed = parse_repo_spec(spec)
    if parsed is None:
        raise ModelNotFoundError(f"{spec!r} is not a hub repo id (org/name or org/name@revision)")
    return parsed


def fetch_model(spec: str, *, local_only: bool = False, encoder_ok: bool = False, select_weights=None) -> Path:
    """The local snapshot directory of hub model ``spec`` (``org/name[@revision]``), downloading what is
    missing (huggingface_hub's progress bars on stderr) unless offline or ``local_only``. ``encoder_ok``: an
    encoder embedding model (``ENCODER_TYPES``, run by mlx-embeddings) is fetched too. ``select_weights(path)``
    (a distributed rank's ``ShardPlan.weight_files``): the snapshot without its weights first, then only the
    weight files it names (None: all). Raises the typed errors of :mod:`errors` (all :class:`ModelLoadError`)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    repo_id, revision = _repo(spec)
    kwargs = _hub_kwargs(local_only)
    try:
        config_file = hf_hub_download(repo_id, "config.json", revision=revision, **kwargs)
        config = json.loads(Path(config_file).read_text())
        if not (encoder_ok and config.get("model_type") in ENCODER_TYPES):
            check_architecture(config, spec)
        patterns = allow_patterns_for(config)
        if select_weights is not None:
            no_weights = [p for p in patterns if "safetensors" not in p]
            files = select_weights(Path(snapshot_download(repo_id, revision=revision, allow_patterns=no_weights,
                                                          **kwargs)))
            if files is not None:
                patterns = no_weights + list(files)
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, **kwargs))
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001  (mapped to a typed error, or re-raised as it is)
        raise _typed_error(exc, spec, kwargs["local_files_only"]) from exc
    if not any(path.glob("*.safetensors")):
        raise UnsupportedArchitectureError(
            f"{spec} has no .safetensors weights (mlx-lm and mlx-vlm read safetensors; look for an MLX or "
            "safetensors version of it, e.g. under mlx-community/)", architecture=config.get("model_type"))
    return path


def fetch_adapter(spec: str) -> Path:
    """The local snapshot of LoRA adapter repo ``spec`` (``org/name[@revision]``): its config and weights,
    downloaded on first use as models are (``fetch_model``); the same typed errors."""
    from huggingface_hub import snapshot_download

    repo_id, revision = _repo(spec)
    kwargs = _hub_kwargs(False)
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=ADAPTER_ALLOW_PATTERNS, **kwargs))
    except Exception as exc:  # noqa: BLE001  (mapped to a typed error, or re-raised as it is)
        raise _typed_error(exc, spec, kwargs["local_files_only"]) from exc


def cached_model_dir(spec: str) -> Path | None:
    """The cached snapshot of ``spec`` if it is complete, without any network access; else None."""
    try:
        return fetch_model(spec, local_only=True)
    except ModelLoadError:
        return None


def _typed_error(exc: Exception, spec: str, offline: bool) -> Exception:
    """huggingface_hub's exception as one of ParaLLM's; an unrelated exception comes back unchanged."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token_hint = "set HF_TOKEN (or run `hf auth login`)"
    if isinstance(exc, GatedRepoError):
        return GatedModelError(
            f"{spec} is a gated model: accept its terms on its hub page, then {token_hint} with a token of "
            "that account")
    if isinstance(exc, RevisionNotFoundError):
        return ModelNotFoundError(f"{spec}: the hub has no such revision (branch, tag or commit)")
    if isinstance(exc, RepositoryNotFoundError):
        return ModelNotFoundError(
            f"{spec}: no such model on the hub, nor a file or directory here (check the name; if it is "
            f"private, {token_hint})")
    if isinstance(exc, RemoteEntryNotFoundError):
        return UnsupportedArchitectureError(
            f"{spec} has no config.json: not an MLX / Hugging Face model repository (a GGUF repository? "
            "download its .gguf file and pass that path)")
    if isinstance(exc, IncompleteSnapshotError):
        return ModelDownloadError(
            f"{spec}: the local copy is incomplete (an interrupted download); run it again with network "
            f"access to finish it ({exc})")
    if isinstance(exc, LocalEntryNotFoundError):
        why = ("offline (HF_HUB_OFFLINE is set)" if offline_mode() else "local_files_only") if offline \
            else "the hub cannot be reached"
        return ModelNotCachedError(
            f"{spec} is not in the local Hugging Face cache ({hub_cache_dir()}) and {why}; download it once "
            f"with network access: parallm pull {spec}")
    if isinstance(exc, (OSError, httpx2.HTTPError)) and not isinstance(exc, HfHubHTTPError):
        return ModelDownloadError(
            f"{spec}: the download stopped part-way ({type(exc).__name__}: {exc}); nothing partial is used. "
            "Run it again to finish it")
    if isinstance(exc, HfHubHTTPError):
        return ModelLoadError(f"{spec}: the hub answered with an error: {exc}")
    return exc


def cached_hub_snapshot(spec: str) -> Path | None:
    """The local hub cache's snapshot directory of the HF repo id ``spec`` (None: not a repo id, or not
    cached). Never downloads (models and LoRA adapters resolve ids through here)."""
    if "/" not in spec or spec.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, local_files_only=True))
    except Exception:
        return None
