"""What coding agents send, as they send it: the first request of Codex CLI 0.171 (``codex exec``, Responses
API) and of Claude Code 2.1.197 (``claude -p``, Messages API), captured verbatim (tests/agent_requests/), and
``parallm serve``'s answers on the default model (8,192-token context) and a tiny random model.

The captured prompts are longer than the default model's context (Codex's 9.2k tokens with its namespaced
tools, Claude Code's 22.9k): on the default model they get each API's context-length error; trimmed to a few
hundred tokens, with every field and tool shape kept, they are answered."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import pytest

from parallm_engine.serve.agent_tools import IGNORED_TOOLS_HEADER, anthropic_tools, responses_tools
from parallm_engine.serve.anthropic_format import MessagesRequest
from parallm_engine.serve.anthropic_format import chat_body as anthropic_chat_body
from parallm_engine.serve.request_identity import identity_fields, request_session
from parallm_engine.serve.responses_format import ResponsesRequest
from parallm_engine.serve.responses_format import chat_body as responses_chat_body
from parallm_engine.serve.server import ServerThread
from parallm_engine.serve.server_kit import chat_request

REQUESTS = Path(__file__).parent / "agent_requests"
CODEX = json.loads((REQUESTS / "codex_exec_0.171.json").read_text())
CLAUDE = json.loads((REQUESTS / "claude_code_2.1.197.json").read_text())
CODEX_THREAD = CODEX["body"]["prompt_cache_key"]
CLAUDE_SESSION = json.loads(CLAUDE["body"]["metadata"]["user_id"])["session_id"]
NAMESPACED = ["multi_agent_v1__" + t["name"] for t in CODEX["body"]["tools"][4]["tools"]]


def trimmed_codex(max_output_tokens: int = 4) -> dict:
    """Codex's request with each message's text cut short, each description dropped and one function tool of
    its eight: all its fields, tool kinds (a function, the namespace, web_search) and message roles kept."""
    body = copy.deepcopy(CODEX["body"])
    body["tools"] = [t for t in body["tools"] if t.get("name") in ("exec_command", "multi_agent_v1")
                     or t["type"] == "web_search"]
    for item in body["input"]:
        for part in item["content"]:
            part["text"] = part["text"][:200]
    for tool in body["tools"]:
        for t in [tool, *tool.get("tools", [])]:
            t.pop("description", None)
    body["max_output_tokens"] = max_output_tokens
    return body


def trimmed_claude(max_tokens: int = 4) -> dict:
    """Claude Code's request with its texts cut short and three of its 25 tools: its system blocks (the billing
    block, cache_control), the system message inside ``messages``, thinking, context_management,
    output_config and metadata kept."""
    body = copy.deepcopy(CLAUDE["body"])
    for block in body["system"]:
        block["text"] = block["text"][:300]
    body["messages"][1]["content"] = body["messages"][1]["content"][:300]
    body["tools"] = [t for t in body["tools"] if t["name"] in ("Bash", "Read", "Edit")]
    for t in body["tools"]:
        t["description"] = t["description"][:100]
    body["max_tokens"] = max_tokens
    return body


def sse_events(lines: list[str]) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine=engine) as srv:
        yield srv


# ----------------------------------------------------------------------------------------------
# The requests as the engine is offered them (no engine)
# ----------------------------------------------------------------------------------------------


def test_codex_request_offers_its_functions_and_namespace_not_web_search():
    req = ResponsesRequest.model_validate(CODEX["body"])
    tools = responses_tools(req.tools)
    names = [t["function"]["name"] for t in tools.tools]
    assert names[:4] == ["exec_command", "write_stdin", "request_user_input", "view_image"]
    assert names[4:4 + len(NAMESPACED)] == NAMESPACED and "multi_agent_v1__spawn_agent" in names
    assert tools.ignored == ["web_search"] and tools.headers() == {IGNORED_TOOLS_HEADER: "web_search"}
    assert tools.reported("multi_agent_v1__spawn_agent") == ("spawn_agent", "multi_agent_v1")
    assert tools.reported("exec_command") == ("exec_command", None)
    chat = chat_request(responses_chat_body(req, [], tools))
    assert [m.role for m in chat.messages] == ["system", "user", "user"]  # its two developer messages: one system prompt
    assert chat.messages[0].content.startswith("You are a coding agent running in the Codex CLI")
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls is True


def test_claude_code_request_has_one_system_prompt_without_the_billing_block():
    req = MessagesRequest.model_validate(CLAUDE["body"])
    body = anthropic_chat_body(req, anthropic_tools(req.tools))
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user"]
    system = body["messages"][0]["content"]
    assert system.startswith("You are a Claude agent") and "x-anthropic-billing-header" not in system
    assert system.endswith(CLAUDE["body"]["messages"][1]["content"])  # the system message, merged after
    assert len(body["tools"]) == 25 and "thinking_token_budget" not in body
    chat_request(body)  # valid as a chat request


def test_the_session_is_read_from_each_agents_ids():
    assert request_session(CODEX["headers"], CODEX["body"]) == CODEX_THREAD
    assert request_session(CLAUDE["headers"], CLAUDE["body"]) == CLAUDE_SESSION
    # From a validated request model as from a JSON body.
    req = ResponsesRequest.model_validate(CODEX["body"])
    assert request_session({}, identity_fields(req)) == CODEX_THREAD
    req = MessagesRequest.model_validate(CLAUDE["body"])
    assert request_session({}, identity_fields(req)) == CLAUDE_SESSION
    # The order: x-session-id, prompt_cache_key, client_metadata, agents' headers, metadata.user_id, user.
    assert request_session({"x-session-id": "mine"}, CODEX["body"]) == "mine"
    assert request_session({}, {"client_metadata": {"thread_id": "t", "session_id": "s"}, "user": "u"}) == "t"
    assert request_session({}, {"client_metadata": {"session_id": "s"}, "user": "u"}) == "s"
    assert request_session({"x-claude-code-session-id": "c"}, {"metadata": {"user_id": "u"}}) == "c"
    assert request_session({}, {"metadata": {"user_id": "plain-user"}}) == "plain-user"
    assert request_session({}, {"metadata": {"user_id": "{not json"}}) == "{not json"
    assert request_session({}, {"user": "u", "safety_identifier": "s"}) == "u"
    assert request_session({}, {"safety_identifier": "s"}) == "s"
    assert request_session({}, {"user": "x" * 1000}) == "x" * 256
    assert request_session({}, {"client_metadata": "not a dict", "metadata": ["no"], "user": 3}) is None


# ----------------------------------------------------------------------------------------------
# On the default model (8,192 tokens of context)
# ----------------------------------------------------------------------------------------------


def test_whole_requests_get_each_apis_context_length_error(server, engine):
    r = httpx.post(f"{server.url}/v1/messages", json=CLAUDE["body"], headers=CLAUDE["headers"], timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("prompt is too long: ") and error["message"].endswith(
        f" tokens > {engine.context_window - 1} maximum")
    r = httpx.post(f"{server.url}/v1/responses", json=CODEX["body"], headers=CODEX["headers"], timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    assert f"maximum context length is {engine.context_window} tokens" in error["message"]


def test_codex_request_is_answered_streamed_and_not(server):
    body = trimmed_codex()
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, headers=CODEX["headers"], timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers[IGNORED_TOOLS_HEADER] == "web_search"
        events = sse_events(list(r.iter_lines()))
    assert events[0]["type"] == "response.created" and events[-1]["type"] in ("response.completed",
                                                                              "response.incomplete")
    final = events[-1]["response"]
    assert final["store"] is False and final["usage"]["input_tokens"] > 0
    r = httpx.post(f"{server.url}/v1/responses", json={**body, "stream": False}, headers=CODEX["headers"], timeout=120)
    assert r.status_code == 200 and r.headers[IGNORED_TOOLS_HEADER] == "web_search"
    assert r.json()["output"] and r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_a_namespaced_call_is_reported_in_its_namespace_and_goes_back(server):
    body = {**trimmed_codex(max_output_tokens=48), "stream": False,
            "tool_choice": {"type": "function", "name": "wait_agent", "namespace": "multi_agent_v1"}}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    calls = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert calls and calls[0]["name"] == "wait_agent" and calls[0]["namespace"] == "multi_agent_v1"
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        events = sse_events(list(r.iter_lines()))
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"
             and e["item"]["type"] == "function_call"]
    assert added and added[0]["name"] == "wait_agent" and added[0]["namespace"] == "multi_agent_v1"
    # Codex sends the call back with its namespace, and its output: the model sees its offered name again.
    call = calls[0]
    follow = {**body, "tool_choice": "auto", "max_output_tokens": 2, "input": [
        *body["input"], {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "agent finished"}]}
    r = httpx.post(f"{server.url}/v1/responses", json=follow, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0  # its prompt extends the first's


def test_namespace_and_tool_errors_name_the_field(server):
    url = f"{server.url}/v1/responses"
    base = {"input": "hi", "max_output_tokens": 2}
    cases = [
        ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]}, "tools[0].tools[0].type"),
        ({"tools": [{"type": "namespace", "name": "n" * 40, "tools": [{"type": "function", "name": "f" * 30}]}]},
         "tools[0].tools[0].name"),
        ({"tools": [{"type": "function", "name": "a__b"}, {"type": "namespace", "name": "a",
                                                           "tools": [{"type": "function", "name": "b"}]}]},
         "tools[1].tools[0].name"),
        ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ]
    for extra, param in cases:
        r = httpx.post(url, json={**base, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    # Only hosted tools: none offered, the request answered.
    r = httpx.post(url, json={**base, "tools": [{"type": "web_search"}, {"type": "file_search"}]}, timeout=60)
    assert r.status_code == 200 and r.headers[IGNORED_TOOLS_HEADER] == "web_search,file_search"


def test_claude_code_request_is_answered_streamed_and_not(server):
    body = trimmed_claude()
    body["tools"].append({"type": "web_search_20250305", "name": "web_search", "max_uses": 5})
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers=CLAUDE["headers"], timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers[IGNORED_TOOLS_HEADER] == "web_search_20250305"
        lines = list(r.iter_lines())
    kinds = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "ping" in kinds
    r = httpx.post(f"{server.url}/v1/messages", json={**body, "stream": False}, headers=CLAUDE["headers"], timeout=120)
    assert r.status_code == 200 and r.json()["type"] == "message" and r.json()["usage"]["cache_read_input_tokens"] > 0
    # A tool_choice naming the server tool is refused: it is not offered.
    r = httpx.post(f"{server.url}/v1/messages", json={**body, "stream": False,
                                                       "tool_choice": {"type": "tool", "name": "web_search"}},
                   headers=CLAUDE["headers"], timeout=120)
    assert r.status_code == 400 and "web_search" in r.json()["error"]["message"]


def test_the_billing_block_does_not_change_the_prompt(server):
    def count(body: dict) -> int:
        body = {k: body[k] for k in ("model", "messages", "system", "tools")}
        r = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, headers=CLAUDE["headers"], timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    first, other = trimmed_claude(), trimmed_claude()
    other["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.197.207; cc_entrypoint=sdk-cli;"
    without = trimmed_claude()
    without["system"] = without["system"][1:]
    assert count(first) == count(other) == count(without)


def test_models_tell_the_context_window(server, engine):
    ctx = engine.context_window
    card = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    assert card["max_model_len"] == card["context_length"] == card["context_window"] == card["max_context_length"] == ctx
    card = httpx.get(f"{server.url}/v1/models/{card['id']}", headers={"anthropic-version": "2023-06-01"},
                     timeout=30).json()
    assert card["max_input_tokens"] == card["max_tokens"] == ctx - 1 and card["lifecycle"] == "active"


# ----------------------------------------------------------------------------------------------
# Sessions (a tiny random model: the pins the engine keeps)
# ----------------------------------------------------------------------------------------------


def test_each_agents_session_pins_its_context(tiny_32k_model_dir):
    from parallm_engine import Engine

    eng = Engine(str(tiny_32k_model_dir), kv_disk=0, session_ttl=30.0)
    try:
        with ServerThread(engine=eng) as srv:
            r = httpx.post(f"{srv.url}/v1/responses", json={**trimmed_codex(), "model": None, "stream": False},
                           headers=CODEX["headers"], timeout=60)
            assert r.status_code == 200, r.text
            r = httpx.post(f"{srv.url}/v1/messages", json={**trimmed_claude(), "model": None, "stream": False},
                           headers=CLAUDE["headers"], timeout=60)
            assert r.status_code == 200, r.text
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           headers={"x-session-id": "completion-session"}, timeout=60)
            assert r.status_code == 200, r.text
            pins = eng.run_on_engine_thread(lambda: set(eng._scheduler.kv.sessions.pins))
    finally:
        eng.shutdown()
    assert pins == {CODEX_THREAD, CLAUDE_SESSION, "completion-session"}
