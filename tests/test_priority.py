"""``priority`` from every front end reaches the scheduler: smaller runs first (vLLM's convention).

One engine with a single decode slot makes the order observable: while a long request holds the slot,
two short ones queue; the one with the smaller priority must finish first, though it was submitted
second. Without priorities the queue is FIFO, so the same submission order finishes the other way.
"""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from llama_index.core.llms import ChatMessage
from openai import OpenAI
from pydantic import ValidationError

from parallm_engine.serve.server import ServerThread
from parallm_integrations import ChatParaLLM
from parallm_integrations.llama_index import ParaLLMLlamaIndex

ONE_SLOT = {"max_batch_size": 1}


@pytest.fixture(scope="module")
def one_slot_engine(tiny_model_dir):
    from parallm_engine import get_engine

    return get_engine(str(tiny_model_dir), **ONE_SLOT)


def _blocker(engine):
    """A long request that holds the only decode slot while the others queue behind it."""
    handle = engine.submit("blocker " * 8, max_tokens=400, ignore_eos=True, temperature=0)
    deadline = time.monotonic() + 60
    while engine.running_count == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return handle


async def _finish_order(calls: dict) -> list[str]:
    """Start the calls 0.1 s apart, in order (all while the blocker runs); the order they finish in."""
    order: list[str] = []

    async def run(delay, name, make):
        await asyncio.sleep(delay)
        await make()
        order.append(name)

    await asyncio.gather(*(run(0.1 * i, name, make) for i, (name, make) in enumerate(calls.items())))
    return order


def test_langchain_priority_reorders_the_queue(one_slot_engine, tiny_model_dir):
    llm = ChatParaLLM(model=str(tiny_model_dir), engine_kwargs=ONE_SLOT, temperature=0, max_tokens=4)
    _blocker(one_slot_engine)
    order = asyncio.run(_finish_order({
        "late-low": lambda: llm.ainvoke("first submitted", priority=5),
        "early-high": lambda: llm.ainvoke("second submitted", priority=-5),
    }))
    assert order == ["early-high", "late-low"]
    _blocker(one_slot_engine)  # control: equal priorities are FIFO
    order = asyncio.run(_finish_order({
        "first": lambda: llm.ainvoke("first submitted"),
        "second": lambda: llm.ainvoke("second submitted"),
    }))
    assert order == ["first", "second"]


def test_langchain_priority_field_is_the_default(one_slot_engine, tiny_model_dir):
    urgent = ChatParaLLM(model=str(tiny_model_dir), engine_kwargs=ONE_SLOT, temperature=0, max_tokens=4, priority=-3)
    plain = ChatParaLLM(model=str(tiny_model_dir), engine_kwargs=ONE_SLOT, temperature=0, max_tokens=4)
    assert urgent._identifying_params["priority"] == -3
    _blocker(one_slot_engine)
    order = asyncio.run(_finish_order({
        "plain": lambda: plain.ainvoke("first submitted"),
        "urgent": lambda: urgent.ainvoke("second submitted"),
    }))
    assert order == ["urgent", "plain"]


def test_llama_index_priority(one_slot_engine, tiny_model_dir):
    llm = ParaLLMLlamaIndex(model=str(tiny_model_dir), engine_kwargs=ONE_SLOT, temperature=0, max_tokens=4)
    _blocker(one_slot_engine)
    order = asyncio.run(_finish_order({
        "late-low": lambda: llm.achat([ChatMessage(role="user", content="first")], priority=5),
        "early-high": lambda: llm.achat([ChatMessage(role="user", content="second")], priority=-5),
    }))
    assert order == ["early-high", "late-low"]


@pytest.mark.parametrize("bad", ["high", 1.5, True])
def test_priority_must_be_an_integer(tiny_model_dir, bad):
    with pytest.raises(ValidationError):
        ChatParaLLM(model=str(tiny_model_dir), priority=bad)
    with pytest.raises(ValidationError):
        ParaLLMLlamaIndex(model=str(tiny_model_dir), priority=bad)
    llm = ChatParaLLM(model=str(tiny_model_dir), engine_kwargs=ONE_SLOT, max_tokens=2)
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.invoke("hi", priority=bad)


def test_server_priority_field(one_slot_engine):
    with ServerThread(engine=one_slot_engine) as srv:
        client = OpenAI(base_url=srv.base_url, api_key="EMPTY", max_retries=0, timeout=120)
        name = one_slot_engine.model_name
        msgs = [{"role": "user", "content": "hi"}]
        out = client.chat.completions.create(model=name, messages=msgs, max_tokens=2, extra_body={"priority": -1})
        assert out.choices[0].message is not None
        for bad in ("high", 2**40):
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model=name, messages=msgs, max_tokens=2, extra_body={"priority": bad})
        remote = ChatParaLLM(base_url=srv.base_url, api_key="EMPTY", model=name, temperature=0, max_tokens=4)
        _blocker(one_slot_engine)
        order = asyncio.run(_finish_order({
            "late-low": lambda: remote.ainvoke("first submitted", priority=5),
            "early-high": lambda: remote.ainvoke("second submitted", priority=-5),
        }))
        assert order == ["early-high", "late-low"]
