"""Where the integrations meet the engine: only its public API (``registry.peek``, ``Engine.is_alive``,
``Engine.submit``'s keywords), nothing of MLX on import, one logprob formatter, tool calls parsed once
(by the engine or the server) and turned into LangChain calls the same way on both paths, and
``Engine.stats()`` safe from any thread."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from parallm_engine import Choice, TokenLogprob, Usage
from parallm_engine.core import registry
from parallm_engine.formats.chat_format import ToolCall

from parallm_integrations import _remote_client
from parallm_integrations._common import chat_generation, chat_result

from .conftest import settled_stats


def test_importing_the_integrations_imports_no_engine_and_the_plain_engine_modules_no_mlx():
    code = (
        "import sys\n"
        "import parallm_integrations, parallm_integrations.llama_index, parallm_integrations._remote\n"
        "from parallm_integrations import ChatParaLLM, ParaLLM\n"
        "from parallm_integrations.llama_index import ParaLLMLlamaIndex\n"
        "ChatParaLLM(base_url='http://127.0.0.1:9/v1'); ParaLLM(base_url='http://127.0.0.1:9/v1')\n"
        "ParaLLMLlamaIndex(base_url='http://127.0.0.1:9/v1')\n"
        "engine_mods = sorted(m for m in sys.modules if m.startswith('parallm_engine'))\n"
        "import parallm_engine.errors, parallm_engine.sampling.logprobs, parallm_engine.formats.chat_format\n"
        "import parallm_engine.sampling.sampling_params, parallm_engine.core.registry\n"
        "import parallm_integrations.errors\n"
        "import json\n"
        "print(json.dumps([engine_mods, sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm'))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    engine_mods, mlx_mods = json.loads(out.stdout.strip().splitlines()[-1])
    # Constructing with base_url checks the sampling settings with the engine's plain-Python checks.
    assert set(engine_mods) <= {"parallm_engine", "parallm_engine.runner", "parallm_engine.models",  # (empty package inits)
                                "parallm_engine.sampling", "parallm_engine.spec", "parallm_engine.cpu_info",
                                "parallm_engine.runner.backend", "parallm_engine.errors", "parallm_engine.models.import_notices",
                                "parallm_engine.sampling.sampling_params", "parallm_engine.sampling.spec_config",
                                "parallm_engine.settings"}
    assert mlx_mods == [], "MLX was imported"


def test_registry_peek_and_is_alive(tiny_model_dir):
    config = {"max_batch_size": 3}  # an engine of its own: this test shuts it down
    assert registry.peek(str(tiny_model_dir), **config) is None  # nothing created by asking
    assert registry.peek(str(tiny_model_dir), **config) is None
    eng = registry.get_engine(str(tiny_model_dir), **config)
    try:
        assert eng.is_alive and registry.peek(str(tiny_model_dir), **config) is eng
        assert registry.peek(str(tiny_model_dir)) is not eng  # other settings, other engine
    finally:
        eng.shutdown()
    assert not eng.is_alive and registry.peek(str(tiny_model_dir), **config) is None
    again = registry.get_engine(str(tiny_model_dir), **config)
    try:
        assert again is not eng and again.is_alive
    finally:
        again.shutdown()


def test_stats_never_walks_the_prefix_tree_off_the_engine_thread(tiny_engine):
    cache = tiny_engine._scheduler.prefix_cache
    callers: set[str] = set()
    original = cache.stats

    def recording_stats():
        callers.add(threading.current_thread().name)
        return original()

    cache.stats = recording_stats
    errors: list[BaseException] = []
    stop = threading.Event()

    def poll():
        try:
            while not stop.is_set():
                s = tiny_engine.stats()
                assert s["waiting"] >= 0 and s["prefilling"] >= 0 and s["prefix_cache"]["bytes"] >= 0
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    pollers = [threading.Thread(target=poll) for _ in range(3)]
    try:
        for t in pollers:
            t.start()
        prompts = [tiny_engine.encode(f"Tell me about thread safety, part {i}.") for i in range(6)]
        tiny_engine.generate(prompts, max_tokens=6, temperature=0)
    finally:
        stop.set()
        for t in pollers:
            t.join()
        del cache.stats
    assert not errors, errors
    assert callers == {"parallm-engine"}  # published by the engine thread, read by the others
    assert settled_stats(tiny_engine)["prefix_cache"]["bytes"] > 0


def test_one_logprob_formatter_reports_minus_inf_as_the_floor():
    from parallm_engine.sampling.logprobs import LOGPROB_FLOOR, chat_logprobs

    from parallm_integrations._messages import logprobs_to_openai
    from parallm_integrations.llama_index._responses import logprobs_lists

    lps = [TokenLogprob(5, "Hi", -0.25, [(5, "Hi", -0.25), (6, "Yo", float("-inf"))]),
           TokenLogprob(7, "!", float("-inf"), [])]
    formatted = logprobs_to_openai(lps)
    assert formatted == chat_logprobs(lps)  # the engine's formatter, the one `parallm serve` answers with
    assert formatted["content"][1]["logprob"] == LOGPROB_FLOOR == -9999.0
    assert formatted["content"][0]["top_logprobs"][1]["logprob"] == LOGPROB_FLOOR
    json.dumps(formatted, allow_nan=False)  # no -inf left to break a JSON encoder
    assert logprobs_to_openai(formatted) == formatted  # a server's dict is passed on as it is
    assert logprobs_to_openai([]) is None and logprobs_to_openai(None) is None
    rows = logprobs_lists(lps)
    assert [r[0].logprob for r in rows] == [-0.25, LOGPROB_FLOOR] and rows[0][1].logprob == LOGPROB_FLOOR
    # In-process metadata carries the floor as well.
    msg = chat_generation(Choice(0, "Hi!", [5, 7], "stop", logprobs=lps, content="Hi!"), Usage(3, 2, 0), "m").message
    assert msg.response_metadata["logprobs"] == formatted


def _server_response(calls: list[tuple[str, str]]):
    from openai.types.chat import ChatCompletion

    return ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None,
            "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                           for i, (n, a) in enumerate(calls)]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}})


def test_tool_calls_become_langchain_calls_the_same_way_on_both_paths():
    """The engine (in-process) and the server (base_url) parse the calls; one function makes LangChain calls
    of them: a call whose arguments are not a JSON object is an invalid call keeping the raw text."""
    remote = _remote_client._chat_result(_server_response([("get_weather", '{"city": "Paris"}'),
                                                           ("get_weather", '{"city": ')]))
    remote_msg = chat_result(remote, "m").generations[0].message
    local = Choice(0, "<tool_call>...</tool_call>", [], "stop", content="",
                   tool_calls=[ToolCall("call_0", "get_weather", {"city": "Paris"})])
    local_msg = chat_result(type("R", (), {"choices": [local], "usage": Usage(5, 9, 0)})(), "m").generations[0].message
    assert remote_msg.tool_calls == local_msg.tool_calls == [
        {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_0", "type": "tool_call"}]
    (bad,) = remote_msg.invalid_tool_calls
    assert (bad["name"], bad["args"], bad["id"]) == ("get_weather", '{"city": ', "call_1") and bad["error"]
    assert local_msg.invalid_tool_calls == []
    assert remote_msg.response_metadata["finish_reason"] == local_msg.response_metadata["finish_reason"] == "tool_calls"
    assert remote_msg.content == local_msg.content == ""
    single = chat_result(remote, "m", single_call=True).generations[0].message
    assert len(single.tool_calls) == 1 and single.invalid_tool_calls == []


def test_the_local_path_says_how_to_install_a_missing_engine(monkeypatch):
    """An ImportError of the engine or of MLX becomes EngineNotInstalledError (an ImportError) naming the
    extra; an unrelated ImportError inside the engine is not disguised."""
    import parallm_engine

    from parallm_integrations import _common
    from parallm_integrations.errors import EngineNotInstalledError

    def missing_mlx(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'mlx'", name="mlx")

    monkeypatch.setattr(parallm_engine, "get_engine", missing_mlx)
    with pytest.raises(EngineNotInstalledError, match=r"pip install 'parallm-integrations\[engine\]'"):
        _common.resolve_engine("some-model")

    def missing_family(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'mlx_lm.models.nope'", name="mlx_lm.models.nope")

    monkeypatch.setattr(parallm_engine, "get_engine", missing_family)
    with pytest.raises(ModuleNotFoundError) as info:
        _common.resolve_engine("some-model")
    assert not isinstance(info.value, EngineNotInstalledError)


def test_a_servers_reasoning_is_kept_out_of_the_content():
    """``reasoning_content`` from a server (vLLM, DeepSeek, parallm serve) lands where the in-process
    engine's reasoning does: ``RemoteChoice.reasoning`` / ``RemoteDelta.reasoning``, never the text."""
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from parallm_integrations import _remote

    resp = ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital."}}]})
    msg = chat_result(_remote_client._chat_result(resp), "m").generations[0].message
    assert msg.content == "Paris." and msg.additional_kwargs["reasoning_content"] == "France's capital."

    state = _remote_client._StreamState()
    deltas = []
    for delta in ({"reasoning_content": "Hmm."}, {"content": "Paris."}):
        deltas += state.feed(ChatCompletionChunk.model_validate({
            "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta}]}), completion=False)
    assert [(d.reasoning, d.text) for d in deltas] == [("Hmm.", ""), (None, "Paris.")]
    chunks = _remote._ChatChunks({"model": "m"})
    out = [c.message for d in deltas for c in chunks.feed(d)]
    assert [m.additional_kwargs.get("reasoning_content") for m in out] == ["Hmm.", None]
    assert "".join(m.content for m in out) == "Paris."
