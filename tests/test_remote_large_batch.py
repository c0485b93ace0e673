"""A remote ``ParaLLM`` batch larger than one server request may carry (``parallm serve`` refuses one
request over a quarter of its queue: 400 ``too_many_sequences``) goes as several concurrent requests,
results in input order, each equal to that prompt run alone."""

from __future__ import annotations

import asyncio

import openai
import pytest
from openai import OpenAI

from parallm_engine.serve.server import ServerThread
from parallm_integrations import ParaLLM
from parallm_integrations._remote_client import MAX_SEQUENCES_PER_REQUEST


@pytest.fixture(scope="module")
def server(tiny_engine):
    with ServerThread(engine=tiny_engine) as srv:
        yield srv


def test_batch_over_the_request_share_is_split(server, tiny_engine):
    limit = tiny_engine.max_queue // 4
    prompts = [f"Item {i}:" for i in range(limit + 44)]
    direct = OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="split it"):  # one request is refused ...
        direct.completions.create(model=tiny_engine.model_name, prompt=prompts, max_tokens=1)
    llm = ParaLLM(base_url=server.base_url, api_key="EMPTY", model=tiny_engine.model_name, temperature=0,
                  max_tokens=2)
    out = llm.batch(prompts)  # ... the client splits it
    assert len(out) == len(prompts)
    for i in (0, MAX_SEQUENCES_PER_REQUEST, len(prompts) - 1):
        assert out[i] == llm.invoke(prompts[i])
    assert asyncio.run(llm.abatch(prompts))[-5:] == out[-5:]
    result = llm.generate(prompts[:70], n=2)  # n counts: 32 prompts x 2 per request
    assert [len(g) for g in result.generations] == [2] * 70
