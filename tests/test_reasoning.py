"""Reasoning end to end: Qwen3 ``<think>`` and gpt-oss harmony, on every route and class, with budgets.

Models (``tests/reasoning_models.py``): a tiny random-weight Qwen3 whose real chat template opens ``<think>\\n``
in the generation prompt (so everything the model writes is reasoning until ``</think>``, which the greedy
tiny model never writes by itself), and a tiny gpt-oss with harmony tokens, made to open an analysis message
by a lark grammar whose answer part follows ``<|end|><|start|>assistant<|channel|>final<|message|>``.

How the pieces are made deterministic: greedy decoding plus a ``thinking_token_budget`` of N. The engine
counts the tokens the model writes inside the span and, at N, forces the family's close (``</think>``; for
harmony the end of the analysis message and the start of the final one); the model then writes its answer.
So every response has N reasoning tokens, then the close, then content, and each test checks the route's
fields against the token ids: reasoning = the first N tokens' text, content = the text after the close,
``reasoning_tokens`` = N. A budget changes only its own row (checked against the same requests alone, in
one batch, and against mlx-lm's greedy continuation after the close), on both engine paths (the module's
engine runs the default backend, one test the pure-MLX ``cpu-mlx`` one), speculating or not.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from parallm_engine import get_engine
from parallm_engine.serve.server import ServerThread
from tests.reasoning_models import build_gpt_oss_harmony, build_qwen3_thinking

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

KEY = "test-key"
QUESTION = [{"role": "user", "content": "Is 17 a prime number?"}]
BUDGET = 4
MAX = 16
GREEDY = {"temperature": 0, "max_tokens": MAX}
HARMONY_GRAMMAR = ('start: <|channel|> "analysis" <|message|> THINK <|end|> <|start|> "assistant" <|channel|> '
                   '"final" <|message|> ANSWER\nTHINK: /[a-z ]+/\nANSWER: /[a-z ]+/')
HARMONY_RF = {"type": "lark", "grammar": HARMONY_GRAMMAR}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_qwen3_thinking(tmp_path_factory.mktemp("tiny-qwen3-think"))


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory):
    return build_gpt_oss_harmony(tmp_path_factory.mktemp("tiny-gpt-oss-harmony"))


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    return get_engine(str(qwen3_dir))


@pytest.fixture(scope="module")
def harmony(harmony_dir):
    return get_engine(str(harmony_dir))


@pytest.fixture(scope="module")
def server(qwen3):
    with ServerThread(engine=qwen3, api_key=KEY) as srv:
        yield srv


def _end_id(engine) -> int:
    return engine.tokenizer.get_vocab()["</think>"]


def _split(engine, token_ids: list[int], n: int) -> tuple[str, str]:
    """(reasoning, content) the token ids mean when the close sits at position ``n``."""
    return engine.decode(token_ids[:n]).strip(), engine.decode(token_ids[n + 1 :]).strip()


@pytest.fixture(scope="module")
def expected(qwen3):
    """The greedy budgeted answer to QUESTION: its reasoning and content (from the token ids)."""
    result = qwen3.chat(QUESTION, thinking_token_budget=BUDGET, **GREEDY)
    ids = result.choices[0].token_ids
    assert ids[BUDGET] == _end_id(qwen3) and _end_id(qwen3) not in ids[:BUDGET]
    reasoning, content = _split(qwen3, ids, BUDGET)
    assert reasoning and content
    return {"reasoning": reasoning, "content": content, "ids": ids}


# -- the engine: counts and budgets -----------------------------------------------------------------------

@pytest.mark.parametrize("budget", [0, 1, 5])
def test_budget_closes_reasoning_after_exactly_n_tokens(qwen3, qwen3_dir, budget):
    from mlx_lm import load

    from tests.model_zoo import reference_greedy

    free = qwen3.chat(QUESTION, **GREEDY).choices[0]
    assert _end_id(qwen3) not in free.token_ids  # the tiny model never closes its reasoning by itself
    assert free.content == "" and free.reasoning == qwen3.decode(free.token_ids).strip()

    result = qwen3.chat(QUESTION, thinking_token_budget=budget, **GREEDY)
    c = result.choices[0]
    assert c.token_ids[:budget] == free.token_ids[:budget]  # nothing changes before the budget is spent
    assert c.token_ids[budget] == _end_id(qwen3)  # then the close, forced
    assert result.usage.reasoning_tokens == budget
    assert result.usage.as_dict()["completion_tokens_details"] == {"reasoning_tokens": budget}
    reasoning, content = _split(qwen3, c.token_ids, budget)
    assert (c.reasoning or "") == reasoning and c.content == content and content
    # After the close the model answers as itself: mlx-lm's greedy continuation of the same context.
    model, _ = load(str(qwen3_dir))
    prompt = qwen3.apply_chat_template(QUESTION)
    rest = c.token_ids[budget + 1 :]
    assert reference_greedy(model, prompt + c.token_ids[: budget + 1], len(rest)) == rest


def test_unbudgeted_reasoning_tokens_are_counted(qwen3):
    result = qwen3.chat(QUESTION, **GREEDY)
    assert result.usage.reasoning_tokens == MAX == result.usage.completion_tokens
    closed = qwen3.generate([qwen3.apply_chat_template(QUESTION, enable_thinking=False)], **GREEDY)[0]
    assert closed.usage.reasoning_tokens == 0 and closed.choices[0].reasoning is None


def test_budgeted_row_leaves_the_rest_of_its_batch_alone(qwen3):
    """One batch: a budgeted row, two greedy rows and a seeded sampled one; each unbudgeted row's tokens are
    what it gets alone, and the budgeted row's are what it gets alone."""
    prompts = [qwen3.apply_chat_template([{"role": "user", "content": q}])
               for q in ("Is 17 a prime number?", "Name a colour.", "Count to three.", "Say hi.")]
    settings = [{"thinking_token_budget": 3, **GREEDY}, GREEDY, GREEDY,
                {"temperature": 0.8, "seed": 7, "max_tokens": MAX}]
    alone = [qwen3.generate([p], **kw)[0].choices[0].token_ids for p, kw in zip(prompts, settings)]
    handles = [qwen3.submit(p, **kw) for p, kw in zip(prompts, settings)]
    together = [[t for d in h for t in d.token_ids] for h in handles]
    assert together == alone
    assert alone[0][3] == _end_id(qwen3) and _end_id(qwen3) not in alone[1] + alone[2]


def test_budget_while_speculating_and_on_the_pure_mlx_path(qwen3, qwen3_dir, expected):
    """The greedy tiny model repeats itself in its reasoning, so n-gram drafts are proposed and accepted: a
    budgeted row does not speculate while its budget may force, and its tokens stay the same. The pure-MLX
    engine path (``cpu-mlx``) gives the same tokens."""
    spec = qwen3.chat(QUESTION, thinking_token_budget=BUDGET, speculative={"method": "ngram", "num_tokens": 4},
                      **GREEDY)
    assert spec.choices[0].token_ids == expected["ids"] and spec.usage.reasoning_tokens == BUDGET
    mlx_engine = get_engine(str(qwen3_dir), backend="cpu-mlx")
    assert mlx_engine.backend.name == "cpu-mlx"
    result = mlx_engine.chat(QUESTION, thinking_token_budget=BUDGET, **GREEDY)
    assert result.choices[0].token_ids == expected["ids"] and result.usage.reasoning_tokens == BUDGET


def test_harmony_budget_closes_the_analysis_message(harmony):
    ids = harmony.tokenizer.get_vocab()
    free = harmony.chat(QUESTION, response_format=HARMONY_RF, **GREEDY)
    assert free.choices[0].content == "" and free.usage.reasoning_tokens == MAX - 3  # <|channel|>analysis<|message|>
    result = harmony.chat(QUESTION, response_format=HARMONY_RF, thinking_token_budget=BUDGET, **GREEDY)
    c = result.choices[0]
    out = c.token_ids
    start = out.index(ids["<|message|>"]) + 1
    assert out[start + BUDGET] == ids["<|end|>"] and out[:start + BUDGET] == free.choices[0].token_ids[:start + BUDGET]
    close = harmony.decode(out[start + BUDGET : out.index(ids["<|message|>"], start) + 1])
    assert close == "<|end|><|start|>assistant<|channel|>final<|message|>"
    assert result.usage.reasoning_tokens == BUDGET
    assert c.reasoning.strip() == harmony.decode(out[start : start + BUDGET]).strip()
    assert c.content and "<|" not in c.content and c.content in harmony.decode(out)


def test_budget_validation(qwen3):
    from parallm_engine.errors import InvalidRequestError

    for bad in (-1, 1.5, "3", True):
        with pytest.raises(InvalidRequestError):
            qwen3.chat(QUESTION, thinking_token_budget=bad, **GREEDY)


# -- the server: chat completions, Responses, Messages, streamed and not ------------------------------------

@pytest.fixture
def name(qwen3):
    return qwen3.model_name


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def test_chat_completions(oai, name, expected):
    body = {"thinking_token_budget": BUDGET}
    r = oai.chat.completions.create(model=name, messages=QUESTION, extra_body=body, **GREEDY)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == expected["reasoning"] and msg.content == expected["content"]
    assert r.usage.completion_tokens_details.reasoning_tokens == BUDGET

    reasoning, content, usage = "", "", None
    for chunk in oai.chat.completions.create(model=name, messages=QUESTION, extra_body=body, stream=True,
                                             stream_options={"include_usage": True}, **GREEDY):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            assert not (content and (choice.delta.model_extra or {}).get("reasoning_content"))  # reasoning first
            content += choice.delta.content or ""
    assert (reasoning, content) == (expected["reasoning"], expected["content"])
    assert usage.completion_tokens_details.reasoning_tokens == BUDGET

    # reasoning_effort "none": the template's switch is off (an empty think block), nothing is reasoning
    r = oai.chat.completions.create(model=name, messages=QUESTION, reasoning_effort="none", **GREEDY)
    assert "reasoning_content" not in r.choices[0].message.model_extra
    assert r.usage.completion_tokens_details.reasoning_tokens == 0 and r.choices[0].message.content


def test_responses(oai, name, expected):
    body = {"thinking_token_budget": BUDGET}
    r = oai.responses.create(model=name, input=QUESTION[0]["content"], max_output_tokens=MAX, temperature=0,
                             extra_body=body)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text == expected["reasoning"]
    assert r.output_text == expected["content"]
    assert r.usage.output_tokens_details.reasoning_tokens == BUDGET

    events = list(oai.responses.create(model=name, input=QUESTION[0]["content"], max_output_tokens=MAX,
                                       temperature=0, extra_body=body, stream=True))
    kinds = [e.type for e in events]
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (expected["reasoning"], expected["content"])
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == expected["reasoning"]
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == BUDGET


def test_anthropic_messages(claude, server, name, expected):
    thinking = {"type": "enabled", "budget_tokens": BUDGET}
    greedy = {"max_tokens": MAX, "thinking": thinking, "extra_body": {"temperature": 0}}
    m = claude.messages.create(model=name, messages=QUESTION, **greedy)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == expected["reasoning"] and m.content[0].signature
    assert m.content[1].text == expected["content"]

    raw = list(claude.messages.create(model=name, messages=QUESTION, stream=True, **greedy))
    block0 = [e for e in raw if getattr(e, "index", None) == 0]
    assert block0[0].type == "content_block_start" and block0[0].content_block.type == "thinking"
    assert [e.delta.type for e in block0[1:-1]][-1] == "signature_delta"  # right before the block stops
    assert {e.delta.type for e in block0[1:-2]} == {"thinking_delta"} and block0[-1].type == "content_block_stop"
    with claude.messages.stream(model=name, messages=QUESTION, **greedy) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == expected["reasoning"] and final.content[0].signature == m.content[0].signature
    assert final.content[1].text == expected["content"]

    too_big = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY}, json={
        "model": name, "messages": QUESTION, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 8}})
    assert too_big.status_code == 400 and "budget_tokens" in too_big.text


# -- the classes: ChatParaLLM (in-process and base_url) and ParaLLMLlamaIndex -----------------------------

def _lc_check(msg, expected) -> None:
    assert msg.content == expected["content"]
    assert msg.content_blocks[0] == {"type": "reasoning", "reasoning": expected["reasoning"]}
    assert [b["type"] for b in msg.content_blocks] == ["reasoning", "text"]
    assert msg.usage_metadata["output_token_details"]["reasoning"] == BUDGET


@pytest.mark.parametrize("remote", [False, True])
def test_langchain_invoke_and_stream(qwen3_dir, server, name, expected, remote):
    from parallm_integrations import ChatParaLLM

    where = {"base_url": server.base_url, "api_key": KEY} if remote else {}
    llm = ChatParaLLM(model=name if remote else str(qwen3_dir), temperature=0, max_tokens=MAX,
                      model_kwargs={"thinking_token_budget": BUDGET}, **where)
    _lc_check(llm.invoke(QUESTION[0]["content"]), expected)
    chunks = list(llm.stream(QUESTION[0]["content"]))
    kinds = [("reasoning" if c.additional_kwargs.get("reasoning_content") else "text") for c in chunks
             if c.content or c.additional_kwargs.get("reasoning_content")]
    assert kinds == sorted(kinds)  # reasoning chunks first, each its own
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    _lc_check(full, expected)


def test_llama_index_chat_and_stream(qwen3_dir, expected):
    from llama_index.core.base.llms.types import ChatMessage, TextBlock, ThinkingBlock

    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    li = ParaLLMLlamaIndex(model=str(qwen3_dir), temperature=0, max_tokens=MAX,
                           additional_kwargs={"thinking_token_budget": BUDGET})
    messages = [ChatMessage(role="user", content=QUESTION[0]["content"])]
    r = li.chat(messages)
    assert [type(b) for b in r.message.blocks] == [ThinkingBlock, TextBlock]
    assert r.message.blocks[0].content == expected["reasoning"] and r.message.content == expected["content"]
    assert r.additional_kwargs["reasoning_tokens"] == BUDGET
    thinking = ""
    last = None
    for last in li.stream_chat(messages):
        thinking += last.additional_kwargs.get("thinking_delta") or ""
    assert thinking.strip() == expected["reasoning"] and last.message.content == expected["content"]
    assert [b.content for b in last.message.blocks if isinstance(b, ThinkingBlock)] == [expected["reasoning"]]


def test_llama_index_agent_stream_has_thinking_deltas(qwen3_dir):
    """A FunctionAgent (tools bound: decoding is constrained to text or a valid call, the grammar being the
    answer's) streams the reasoning as ``AgentStream.thinking_delta``, the budget closes it, the answer follows."""
    from llama_index.core.agent.workflow import AgentStream, FunctionAgent
    from llama_index.core.base.llms.types import ThinkingBlock

    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    li = ParaLLMLlamaIndex(model=str(qwen3_dir), temperature=0, max_tokens=MAX,
                           additional_kwargs={"thinking_token_budget": BUDGET})

    def noop() -> str:
        """Does nothing."""
        return ""

    async def run():
        agent = FunctionAgent(tools=[noop], llm=li)
        handler = agent.run(user_msg=QUESTION[0]["content"])
        thinking, text = "", ""
        async for ev in handler.stream_events():
            if isinstance(ev, AgentStream):
                thinking += ev.thinking_delta or ""
                text += ev.delta or ""
        return thinking, text, await handler

    thinking, text, out = asyncio.run(run())
    blocks = [b.content for b in out.response.blocks if isinstance(b, ThinkingBlock)]
    assert thinking and blocks == [thinking.strip()] and text.strip() == out.response.content
    assert out.raw["usage"]["completion_tokens_details"]["reasoning_tokens"] == BUDGET
    assert "<think>" not in text and "</think>" not in text


# -- harmony through every route's body and stream (the same typed pieces) and both classes ----------------

def test_harmony_on_every_route_and_class(harmony, harmony_dir):
    from llama_index.core.base.llms.types import ChatMessage, ThinkingBlock

    from parallm_engine.serve import anthropic_format, openai_format, responses_format
    from parallm_engine.serve.metrics import ServerMetrics
    from parallm_engine.serve.server_kit import ChatRun
    from parallm_integrations import ChatParaLLM
    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    kw = {"response_format": HARMONY_RF, "thinking_token_budget": BUDGET, **GREEDY}
    ref = harmony.chat(QUESTION, **kw)
    reasoning, content = ref.choices[0].reasoning, ref.choices[0].content
    assert reasoning and content and ref.usage.reasoning_tokens == BUDGET

    body = openai_format.chat_response(ref, "tiny", single_call=False)
    assert body["choices"][0]["message"]["reasoning_content"] == reasoning
    assert body["choices"][0]["message"]["content"] == content
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == BUDGET
    from parallm_engine.serve.agent_tools import responses_tools

    req = responses_format.ResponsesRequest(input="x")
    out = responses_format.response_body(ref, req, "resp-1", "tiny", single_call=False, tools=responses_tools(None))
    assert [i["type"] for i in out["output"]] == ["reasoning", "message"]
    assert out["output"][0]["content"][0]["text"] == reasoning and out["output"][1]["content"][0]["text"] == content
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == BUDGET
    msg = anthropic_format.message_response(ref, "tiny", single_call=False, stops=[])
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in msg["content"]] == \
        [("thinking", reasoning), ("text", content)]

    async def streams():
        loop = asyncio.get_running_loop()
        prompt = harmony.apply_chat_template(QUESTION)

        def run():
            return ChatRun([harmony.submit(prompt, loop=loop, **kw)], openai_format.Timing(ServerMetrics()), None)

        first = run()
        chat = [x async for x in openai_format.chat_stream(first.handles, first.timing, "tiny", False, True)]
        resp = [x async for x in responses_format.response_stream(run(), req, "resp-2", "tiny", False,
                                                                       responses_tools(None), lambda b: None)]
        anth = [x async for x in anthropic_format.message_stream(run(), "tiny", False, [])]
        return chat, resp, anth

    chat, resp, anth = asyncio.run(streams())
    chunks = [json.loads(x[6:]) for x in chat if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == BUDGET
    events = [json.loads(x.split("data: ", 1)[1]) for x in resp]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == reasoning
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == content
    events = [json.loads(x.split("data: ", 1)[1]) for x in anth]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == reasoning
    assert "".join(d.get("text", "") for d in deltas) == content
    assert [d["type"] for d in deltas].count("signature_delta") == 1

    llm = ChatParaLLM(model=str(harmony_dir), temperature=0, max_tokens=MAX, model_kwargs={
        "thinking_token_budget": BUDGET, "response_format": HARMONY_RF})
    lc = llm.invoke(QUESTION[0]["content"])
    assert lc.content_blocks == [{"type": "reasoning", "reasoning": reasoning}, {"type": "text", "text": content}]
    full = None
    for c in llm.stream(QUESTION[0]["content"]):
        full = c if full is None else full + c
    assert full.additional_kwargs["reasoning_content"] == reasoning and full.content == content
    li = ParaLLMLlamaIndex(model=str(harmony_dir), temperature=0, max_tokens=MAX, additional_kwargs={
        "thinking_token_budget": BUDGET, "response_format": HARMONY_RF})
    messages = [ChatMessage(role="user", content=QUESTION[0]["content"])]
    r = li.chat(messages)
    assert [b.content for b in r.message.blocks if isinstance(b, ThinkingBlock)] == [reasoning]
    assert r.message.content == content
    last = None
    for last in li.stream_chat(messages):
        pass
    assert last.message.content == content
    assert [b.content for b in last.message.blocks if isinstance(b, ThinkingBlock)] == [reasoning]


# -- earlier turns' reasoning is not in the next prompt ----------------------------------------------------

@pytest.fixture
def prompts(qwen3, monkeypatch):
    """The prompt (token ids) of every request submitted to the Qwen3 engine during the test."""
    seen: list[list[int]] = []
    submit = qwen3.submit

    def recording(prompt, **kwargs):
        seen.append(list(getattr(prompt, "token_ids", prompt)))
        return submit(prompt, **kwargs)

    monkeypatch.setattr(qwen3, "submit", recording)
    return seen


def test_earlier_reasoning_is_not_in_the_next_prompt(qwen3, qwen3_dir, server, expected, prompts, oai, claude, name):
    from langchain_core.messages import AIMessage, HumanMessage
    from llama_index.core.base.llms.types import ChatMessage, TextBlock, ThinkingBlock

    from parallm_integrations import ChatParaLLM
    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    secret = "SECRET reasoning of turn one"
    follow = "And 19?"
    without = qwen3.apply_chat_template([*QUESTION, {"role": "assistant", "content": expected["content"]},
                                         {"role": "user", "content": follow}])
    # The family's template drops the reasoning an earlier turn wrote into its content, too.
    inline = [*QUESTION, {"role": "assistant", "content": f"<think>\n{secret}\n</think>\n\n{expected['content']}"},
              {"role": "user", "content": follow}]
    assert qwen3.apply_chat_template(inline, allow_special_tokens=True) == without
    assert secret not in qwen3.decode(qwen3.apply_chat_template(inline))

    turn = {"role": "assistant", "content": expected["content"], "reasoning_content": secret}
    oai.chat.completions.create(model=name, messages=[*QUESTION, turn, {"role": "user", "content": follow}],
                                max_tokens=1)
    claude.messages.create(model=name, max_tokens=1, messages=[*QUESTION, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": secret, "signature": "x"}, {"type": "text", "text": expected["content"]}]},
        {"role": "user", "content": follow}])
    first = oai.responses.create(model=name, input=QUESTION[0]["content"], max_output_tokens=MAX, temperature=0,
                                 extra_body={"thinking_token_budget": BUDGET})
    assert first.output[0].type == "reasoning"
    oai.responses.create(model=name, input=follow, previous_response_id=first.id, max_output_tokens=1)
    oai.responses.create(model=name, max_output_tokens=1, input=[
        *QUESTION, {"type": "reasoning", "id": "rs_1", "summary": [],
                    "content": [{"type": "reasoning_text", "text": secret}]},
        {"role": "assistant", "content": expected["content"]}, {"role": "user", "content": follow}])
    ai = AIMessage(content=expected["content"], additional_kwargs={"reasoning_content": secret})
    ChatParaLLM(model=str(qwen3_dir), max_tokens=1).invoke([HumanMessage(QUESTION[0]["content"]), ai,
                                                           HumanMessage(follow)])
    ParaLLMLlamaIndex(model=str(qwen3_dir), max_tokens=1).chat([
        ChatMessage(role="user", content=QUESTION[0]["content"]),
        ChatMessage(role="assistant", blocks=[ThinkingBlock(content=secret), TextBlock(text=expected["content"])]),
        ChatMessage(role="user", content=follow)])
    follow_ups = [p for p in prompts if len(p) > len(qwen3.apply_chat_template(QUESTION))]
    assert len(follow_ups) == 6  # chat, Messages, Responses (stored, and sent back), ChatParaLLM, LlamaIndex
    for p in follow_ups:
        assert p == without, qwen3.decode(p)
    assert secret not in qwen3.decode(without) and first.output[0].content[0].text not in qwen3.decode(without)
