"""Speculative-decoding settings and their validation, in plain Python (no mlx).

A request (or the engine, as its default) asks for speculation with ``speculative=``:

- ``{"method": "ngram", "num_tokens": k, "min_match": n, "max_match": m}``: prompt lookup. The
  continuation of the latest earlier occurrence of the context's last ``m`` .. ``n`` tokens (longest
  first) in the request's own prompt + output is proposed, up to ``k`` tokens per step.
- ``"ngram"`` / ``True``: the same with the defaults below.
- ``False`` / ``"off"`` / ``{"method": "none"}``: no speculation for this request (even with an
  engine-wide default); ``None``: the engine's default.

- ``{"method": "draft", "model": <path or loaded mlx-lm model>, "num_tokens": k}``: a smaller model of
  the same vocabulary proposes ``k`` tokens greedily (``draft_model.py``). A path is checked here (it
  must exist, or look like a Hugging Face id for the local cache); the model is loaded once per process
  and checked against the target (vocabulary, plain-attention caches) when a request or the engine
  first asks for it.

The scheduler runs the settings (``speculative.py``); the integrations and the server import this module
to check them at construction / request time without loading MLX.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallm_engine.errors import InvalidRequestError

MAX_SPEC_TOKENS = 16
MAX_MATCH = 16
_KEYS = {"method", "num_tokens", "min_match", "max_match", "adaptive"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # "ngram", "draft" or "none"
    num_tokens: int = 4  # drafted tokens per step, at most (adaptive k may propose fewer)
    min_match: int = 2  # shortest n-gram that counts as a match
    max_match: int = 4  # longest n-gram tried first
    adaptive: bool = True  # width from measured step costs and acceptance (spec_policy); False: always k
    # "draft": what identifies the draft model (a resolved path, or "<object id>" for a loaded model) ...
    draft_key: str | None = None
    # ... and the model as given (a path, or a loaded mlx-lm model: not compared, not printed).
    model: Any = field(default=None, compare=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_tokens > 0

    def as_dict(self) -> dict:
        if self.method == "draft":
            shown = str(self.model) if isinstance(self.model, (str, os.PathLike)) else self.draft_key
            return {"method": "draft", "model": shown, "num_tokens": self.num_tokens, "adaptive": self.adaptive}
        return {"method": self.method, "num_tokens": self.num_tokens, "min_match": self.min_match,
                "max_match": self.max_match, "adaptive": self.adaptive}


OFF = SpeculativeConfig(method="none", num_tokens=0)


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"speculative.{name} must be an integer, got {type(value).__name__}",
                                  param="speculative")
    if not lo <= value <= hi:
        raise InvalidRequestError(f"speculative.{name} must be in [{lo}, {hi}], got {value}", param="speculative")
    return value


def parse_speculative(value: Any) -> SpeculativeConfig | None:
    """``value`` as a :class:`SpeculativeConfig` (:data:`OFF` when turned off), or None (the engine's
    default). Raises :class:`InvalidRequestError` (``param="speculative"``) for anything else."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if value is False:
        return OFF
    if value is True:
        return SpeculativeConfig()
    if isinstance(value, str):
        value = {"method": value}
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            "speculative must be a mapping such as {'method': 'ngram', 'num_tokens': 4}, a method name, "
            f"a bool or None; got {type(value).__name__}", param="speculative")
    unknown = set(value) - _KEYS - {"model"}
    if unknown:
        raise InvalidRequestError(f"unknown speculative setting(s): {', '.join(sorted(map(str, unknown)))}",
                                  param="speculative")
    method = value.get("method", "ngram")
    if method in ("none", "off"):
        return OFF
    if method == "draft":
        return _parse_draft(value)
    if method != "ngram":
        raise InvalidRequestError(f"unknown speculative method {method!r}; expected 'ngram', 'draft' or 'none'",
                                  param="speculative")
    if "model" in value:
        raise InvalidRequestError("speculative.model applies to the 'draft' method only", param="speculative")
    num_tokens = _int("num_tokens", value.get("num_tokens", 4), 1, MAX_SPEC_TOKENS)
    min_match = _int("min_match", value.get("min_match", 2), 1, MAX_MATCH)
    max_match = _int("max_match", value.get("max_match", max(min_match, 4)), min_match, MAX_MATCH)
    adaptive = value.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise InvalidRequestError("speculative.adaptive must be a bool", param="speculative")
    return SpeculativeConfig("ngram", num_tokens, min_match, max_match, adaptive)


def _adaptive(value: Mapping) -> bool:
    adaptive = value.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise InvalidRequestError("speculative.adaptive must be a bool", param="speculative")
    return adaptive


def _parse_draft(value: Mapping) -> SpeculativeConfig:
    for name in ("min_match", "max_match"):
        if name in value:
            raise InvalidRequestError(f"speculative.{name} applies to the 'ngram' method only", param="speculative")
    model = value.get("model")
    if model is None:
        raise InvalidRequestError("speculative method 'draft' needs 'model': a model directory or .gguf file "
                                  "(or a loaded mlx-lm model) with the target's vocabulary", param="speculative")
    num_tokens = _int("num_tokens", value.get("num_tokens", 4), 1, MAX_SPEC_TOKENS)
    return SpeculativeConfig("draft", num_tokens, adaptive=_adaptive(value), draft_key=draft_key(model), model=model)


def draft_key(model: Any) -> str:
    """What identifies a draft model (the per-process cache's key): a path resolved, a Hugging Face id
    (downloaded once when loaded), or a loaded model's identity. A path that does not exist
    is refused here, before anything is loaded."""
    if isinstance(model, (str, os.PathLike)):
        text = str(model)
        path = Path(text).expanduser()
        if text and path.exists():
            return str(path.resolve())
        if text == "default":
            return text
        if "/" in text and not text.startswith((".", "/", "~")):
            return text  # a hub id: downloaded once into the HF cache when loaded (loader.resolve_model)
        raise InvalidRequestError(f"speculative.model: no such file or directory: {text!r}", param="speculative")
    if callable(model) and hasattr(model, "layers"):  # a loaded mlx-lm model (an mlx.nn.Module)
        return f"<{type(model).__module__}.{type(model).__name__} object at {id(model):#x}>"
    raise InvalidRequestError("speculative.model must be a path to a model directory / .gguf file or a loaded "
                              f"mlx-lm model, got {type(model).__name__}", param="speculative")
