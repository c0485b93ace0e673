"""DSPy on ParaLLM: ``ParaLLMDSPy`` on the shared in-process engine (default model, greedy, few tokens),
``ParaLLMAdapter``'s constrained answers for Predict / ChainOfThought / ReAct, DSPy's threads fanned out on
one engine batch, usage as DSPy reads it, and ``dspy.LM("openai/...")`` against ``parallm serve``."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # DSPy's model metadata: no network
dspy = pytest.importorskip("dspy")

from parallm_engine.errors import ContextLengthExceededError  # noqa: E402
from parallm_engine.serve.server import ServerThread  # noqa: E402

from parallm_integrations import ChatParaLLM, ParaLLMAdapter, ParaLLMDSPy  # noqa: E402

from .conftest import settled_stats  # noqa: E402

KEY = "test-key"


def weather_tool(calls: list):
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    return get_weather


@pytest.fixture
def lm(engine):
    # cache=False: these tests count engine work; DSPy's own cache would answer repeats without it.
    return ParaLLMDSPy(temperature=0, max_tokens=64, cache=False)


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine=engine, api_key=[KEY]) as srv:
        yield srv


def _formats(lm) -> list:
    return [h["kwargs"].get("response_format") for h in lm.history]


def test_shares_the_engine_of_chat_parallm_and_keeps_dspy_defaults(engine, lm):
    assert lm.shared_engine() is engine is ChatParaLLM()._get_engine()
    assert lm.model == "parallm/SmolLM2-135M-Instruct" and lm.model_type == "chat"
    assert ParaLLMDSPy().cache is True and ParaLLMDSPy(num_retries=5).num_retries == 5
    assert lm.supports_response_schema and lm.supports_function_calling
    assert "response_format" in lm.supported_params
    state = lm.dump_state()
    again = dspy.BaseLM.load_state(state, allow_custom_lm_class=True)
    assert type(again) is ParaLLMDSPy and again.kwargs == lm.kwargs and again.cache is False


def test_predict_and_chain_of_thought_parse_in_one_constrained_call(lm):
    with dspy.context(lm=lm, adapter=ParaLLMAdapter()):
        pred = dspy.Predict("question -> answer")(question="What is the capital of France?")
        cot = dspy.ChainOfThought("question -> answer: int")(question="What is 2 plus 2?")
    assert isinstance(pred.answer, str) and pred.answer
    assert isinstance(cot.answer, int) and isinstance(cot.reasoning, str)
    assert len(lm.history) == 2  # one call each: the first answer parsed
    for fmt in _formats(lm):
        assert fmt["type"] == "json_schema"
    assert list(_formats(lm)[1]["json_schema"]["schema"]["properties"]) == ["reasoning", "answer"]
    usage = lm.history[1]["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_default_chat_adapter_parses_through_its_schema_fallback(lm):
    """``dspy.configure(lm=ParaLLMDSPy())`` alone: ChatAdapter first; when the small model's answer does not
    follow its markers, DSPy's JSON fallback sends the signature's schema (ParaLLMDSPy declares support),
    which the engine decodes under."""
    with dspy.context(lm=lm):
        pred = dspy.Predict("question -> answer")(question="What is the capital of France?")
    assert isinstance(pred.answer, str) and pred.answer
    assert _formats(lm)[-1] is not None  # the answer DSPy parsed was constrained


def test_react_with_a_tool_parses_and_calls_only_real_tools(lm):
    calls: list = []
    react = dspy.ReAct("question -> answer", tools=[weather_tool(calls)], max_iters=2)
    with dspy.context(lm=lm, adapter=ParaLLMAdapter()):
        pred = react(question="What is the weather in Paris?")
    assert isinstance(pred.answer, str)
    steps = [k for k in pred.trajectory if k.startswith("tool_name_")]
    assert steps
    for i in range(len(steps)):
        assert pred.trajectory[f"tool_name_{i}"] in ("get_weather", "finish")
        assert "Execution error" not in str(pred.trajectory[f"observation_{i}"])  # arguments the tool takes
    if "get_weather" in pred.trajectory.values():
        assert calls
    # The step's schema ties next_tool_args to next_tool_name: one alternative per tool.
    step_schema = _formats(lm)[0]["json_schema"]["schema"]
    names = [v["properties"]["next_tool_name"]["const"] for v in step_schema["anyOf"]]
    assert names == ["get_weather", "finish"]
    args = step_schema["anyOf"][0]["properties"]["next_tool_args"]
    assert args["required"] == ["city"] and args["additionalProperties"] is False


def test_react_tool_call_runs_the_tool(lm):
    """A step constrained to the tool alternative (as the schema allows): the arguments are the tool's."""
    calls: list = []
    react = dspy.ReAct("question -> answer", tools=[weather_tool(calls)], max_iters=1)
    fmt = ParaLLMAdapter()
    lm_kwargs: dict = {}
    with dspy.context(lm=lm, caller_modules=[react]):
        fmt._prepare_response_format(lm, lm_kwargs, react.react.signature)
    schema = lm_kwargs["response_format"]["json_schema"]["schema"]
    schema["anyOf"] = schema["anyOf"][:1]  # only get_weather
    out = lm("What is the weather in Paris?", response_format=lm_kwargs["response_format"], max_tokens=256)
    step = json.loads(out[0])
    assert step["next_tool_name"] == "get_weather" and set(step["next_tool_args"]) == {"city"}
    react.tools["get_weather"](**step["next_tool_args"])
    assert calls == [step["next_tool_args"]["city"]]


def test_evaluate_with_32_threads_runs_as_one_engine_batch(engine, lm):
    examples = [dspy.Example(question=f"What is {i} plus {i}?", answer=str(2 * i)).with_inputs("question")
                for i in range(32)]
    program = dspy.Predict("question -> answer")
    settled_stats(engine)
    engine.reset_peaks()
    with dspy.context(lm=lm, adapter=ParaLLMAdapter()):
        result = dspy.Evaluate(devset=examples, metric=lambda ex, pred, trace=None: bool(pred.answer),
                               num_threads=32, display_progress=False)(program)
        batch = program.batch(examples[:8], num_threads=8)
    assert result.score == 100.0  # every answer parsed
    assert len(batch) == 8 and all(isinstance(p.answer, str) for p in batch)
    stats = settled_stats(engine)
    assert stats["peak_running"] >= 16, stats  # DSPy's threads decoded together
    assert len(lm.history) == 40


def test_parallel_and_usage_tracking(engine, lm):
    program = dspy.Predict("question -> answer")
    with dspy.context(lm=lm, adapter=ParaLLMAdapter(), track_usage=True):
        first = program(question="Name a color.")
        again = program(question="Name a color.")  # the same prompt: served from the prefix cache
        parallel = dspy.Parallel(num_threads=4)([(program, {"question": f"Name a fruit number {i}."})
                                                 for i in range(4)])
    assert len(parallel) == 4
    usage = again.get_lm_usage()[lm.model]
    assert usage["prompt_tokens"] == first.get_lm_usage()[lm.model]["prompt_tokens"] > 0
    assert usage["completion_tokens"] > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
    assert lm.history[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_async_and_bad_input(lm):
    program = dspy.Predict("question -> answer")

    async def run():
        with dspy.context(lm=lm, adapter=ParaLLMAdapter()):
            return await asyncio.gather(*(program.acall(question=f"Name a city number {i}.") for i in range(3)))

    preds = asyncio.run(run())
    assert all(isinstance(p.answer, str) for p in preds)
    with pytest.raises(dspy.utils.exceptions.LMError) as info:  # the engine's typed error, as DSPy's
        lm("hello " * 20000)
    assert isinstance(info.value.__cause__.__cause__, ContextLengthExceededError), repr(info.value)


def test_dspy_lm_openai_against_parallm_serve(server):
    """DSPy's own LM over HTTP: what it needs from the server is honouring ``response_format`` json_schema,
    which ParaLLMAdapter always sends (DSPy does not know the model supports it)."""
    lm = dspy.LM("openai/SmolLM2-135M-Instruct", api_base=server.base_url, api_key=KEY, temperature=0,
                 max_tokens=64, cache=False)
    with dspy.context(lm=lm, adapter=ParaLLMAdapter()):
        pred = dspy.Predict("question -> answer")(question="What is the capital of France?")
        cot = dspy.ChainOfThought("question -> answer: int")(question="What is 2 plus 2?")
    assert isinstance(pred.answer, str) and pred.answer
    assert isinstance(cot.answer, int)
    assert len(lm.history) == 2
    assert lm.history[0]["usage"]["prompt_tokens"] > 0


def test_parallm_dspy_with_base_url(server):
    lm = ParaLLMDSPy(base_url=server.base_url, api_key=KEY, temperature=0, max_tokens=64, cache=False)
    assert lm.shared_engine() is None
    with dspy.context(lm=lm, adapter=ParaLLMAdapter(), track_usage=True):
        preds = dspy.Predict("question -> answer").batch(
            [dspy.Example(question=f"Name animal number {i}.").with_inputs("question") for i in range(4)],
            num_threads=4)
    assert len(preds) == 4 and all(isinstance(p.answer, str) for p in preds)
    assert lm.history[0]["usage"]["prompt_tokens"] > 0
    assert lm.history[0]["response_model"] == "SmolLM2-135M-Instruct"


def test_stream_equals_complete_and_forward_is_openai_shaped(lm):
    from dspy.lm15 import Config, Message, Request

    request = Request(model=lm.model, messages=(Message.user("Say hello."),),
                      config=Config(max_tokens=16, temperature=0))
    whole = lm.engine.complete(request)
    events = list(lm.engine.stream(request))
    assert [e.type for e in events[:1] + events[-1:]] == ["start", "end"] and len(events) > 3
    assert "".join(e.delta.text for e in events if e.type == "delta") == whole.text
    assert events[-1].usage.output_tokens == whole.usage.output_tokens

    async def astream():
        return [e async for e in lm._async_engine_spec.stream(request)]

    assert [e.type for e in asyncio.run(astream())] == [e.type for e in events]
    response = lm.forward(prompt="Say hello.")
    assert response.choices[0].message.content.startswith(whole.text)  # max_tokens 64, not 16
    assert response.usage["completion_tokens"] > whole.usage.output_tokens and response.model
