"""Who a request is: the one place where ``parallm serve`` (and the ``--ray`` front) reads a request's session
from its headers and body, on every API.

A session names one agent's conversation: the engine pins its context between turns (kv/session_pins.py) and
the Ray front sends its turns to the same replica (ray_routing.py). Clients name it in many ways; the first
one present wins:

1. the ``x-session-id`` header (ParaLLM's own, any API);
2. ``prompt_cache_key`` (OpenAI's field for keeping a conversation's prompt cache; Codex CLI sets it to its
   thread id);
3. ``client_metadata.thread_id``, then ``client_metadata.session_id`` (Codex CLI's request metadata; a
   sub-agent has a thread of its own);
4. the agents' own headers: ``thread-id``, ``session-id`` (Codex CLI), ``x-claude-code-session-id``
   (Claude Code);
5. Anthropic's ``metadata.user_id``: Claude Code sends a JSON string whose ``session_id`` is its session (the
   session is that id); any other string is the session as it is;
6. ``user``, then ``safety_identifier`` (OpenAI's fields naming the end user).

A session is at most :data:`MAX_SESSION_CHARS` characters (longer names are cut).

A request's program (the agent run it is a call of: ``core/programs.py``) is the ``x-parallm-program`` header,
else ParaLLM's ``program`` body field, else (the engine's default) its session.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

MAX_SESSION_CHARS = 256
#: The body fields :func:`request_session` reads (:func:`identity_fields` picks them from a request model).
IDENTITY_FIELDS = ("prompt_cache_key", "client_metadata", "metadata", "user", "safety_identifier", "program")
_AGENT_HEADERS = ("thread-id", "session-id", "x-claude-code-session-id")


def identity_fields(req: Any) -> dict[str, Any]:
    """The identity fields of a validated request model (an API's request, before its translation)."""
    return {name: getattr(req, name, None) for name in IDENTITY_FIELDS}


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _anthropic_user_session(user_id: Any) -> str | None:
    """Claude Code's ``metadata.user_id`` is ``{"device_id", "account_uuid", "session_id"}`` as a JSON string."""
    user_id = _text(user_id)
    if user_id is None:
        return None
    if user_id.startswith("{"):
        try:
            parsed = json.loads(user_id)
        except ValueError:
            return user_id
        if isinstance(parsed, dict) and _text(parsed.get("session_id")):
            return parsed["session_id"]
    return user_id


def request_session(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The session a request names (the order is the module's), or None. ``headers``: a case-insensitive
    mapping (Starlette's) or a dict with lower-case names; ``body``: the request's JSON object, or
    :func:`identity_fields` of its model."""
    client = body.get("client_metadata")
    client = client if isinstance(client, Mapping) else {}
    metadata = body.get("metadata")
    metadata = metadata if isinstance(metadata, Mapping) else {}
    candidates = (
        headers.get("x-session-id"),
        body.get("prompt_cache_key"),
        client.get("thread_id"),
        client.get("session_id"),
        *(headers.get(name) for name in _AGENT_HEADERS),
        _anthropic_user_session(metadata.get("user_id")),
        body.get("user"),
        body.get("safety_identifier"),
    )
    session = next((c for c in map(_text, candidates) if c is not None), None)
    return session[:MAX_SESSION_CHARS] if session else None


def request_program(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The program a request names (``x-parallm-program``, else the ``program`` field), or None: the session."""
    program = next((c for c in map(_text, (headers.get("x-parallm-program"), body.get("program"))) if c), None)
    return program[:MAX_SESSION_CHARS] if program else None


def identity_kwargs(headers: Mapping[str, str], body: Mapping[str, Any]) -> dict[str, str]:
    """``Engine.submit``'s ``session`` and ``program`` for a request, each where it names one."""
    named = {"session": request_session(headers, body), "program": request_program(headers, body)}
    return {k: v for k, v in named.items() if v is not None}
