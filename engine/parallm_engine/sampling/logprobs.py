"""OpenAI's logprobs shapes from the engine's :class:`~parallm_engine.core.request.TokenLogprob` lists.

The one formatter: ``parallm serve`` answers with it and the LangChain / LlamaIndex classes put it in
their metadata in-process (through a server they pass on what the server sent, already in this shape),
so the two paths cannot drift apart. Plain Python: importing it loads no MLX.

A log-probability of ``-inf`` (a token a grammar masked out, or one of zero probability) is reported as
:data:`LOGPROB_FLOOR`, -9999.0, the floor vLLM and OpenAI report: JSON has no ``-inf``, and a float
``-inf`` in LangChain metadata breaks whoever serialises it (``json.dumps``, LangSmith tracing).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

#: What a log-probability of -inf (or NaN) is reported as.
LOGPROB_FLOOR = -9999.0


def finite_logprob(value: float) -> float:
    value = float(value)
    return value if math.isfinite(value) else LOGPROB_FLOOR


def chat_logprobs(logprobs: Iterable[Any] | None) -> dict | None:
    """OpenAI's chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``."""
    if logprobs is None:
        return None
    content = []
    for lp in logprobs:
        content.append({
            "token": lp.token,
            "logprob": finite_logprob(lp.logprob),
            "bytes": list(lp.token.encode("utf-8")),
            "top_logprobs": [
                {"token": tok, "logprob": finite_logprob(val), "bytes": list(tok.encode("utf-8"))}
                for _tid, tok, val in (lp.top_logprobs or [])
            ],
        })
    return {"content": content}


def completion_logprobs(logprobs: Iterable[Any] | None, offset: int = 0) -> dict | None:
    """OpenAI's (legacy) completions ``logprobs``: ``{"tokens", "token_logprobs", "top_logprobs",
    "text_offset"}``; ``offset`` is where the generated text starts in the returned text (an echo)."""
    if logprobs is None:
        return None
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in logprobs:
        out["tokens"].append(lp.token)
        out["token_logprobs"].append(finite_logprob(lp.logprob))
        out["top_logprobs"].append({tok: finite_logprob(val) for _tid, tok, val in (lp.top_logprobs or [])} or None)
        out["text_offset"].append(offset)
        offset += len(lp.token)
    return out


__all__ = ["LOGPROB_FLOOR", "chat_logprobs", "completion_logprobs", "finite_logprob"]
