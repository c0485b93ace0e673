"""Embeddings through the front ends: LangChain ``ParaLLMEmbeddings``, LlamaIndex ``ParaLLMEmbedding`` (in-process
and ``base_url=``) and the server's ``/v1/embeddings`` (OpenAI's shape), on tiny random-weight models."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from openai import OpenAI

from tests.embedding_models import build_bert_encoder, build_decoder_embedder

KEY = "embed-key"
ENGINE = {"decode_lanes": 1}
DOCS = ["the cat sat on the mat", "Paris is the capital of France.", "a blue river in the mountains",
        "what is the tallest mountain?"] * 8


def cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def close(got, want) -> bool:
    return len(got) == len(want) and all(cos(a, b) >= 0.9999 for a, b in zip(got, want))


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory):
    return str(build_decoder_embedder(tmp_path_factory.mktemp("emb") / "qwen3-embedding-tiny"))


@pytest.fixture(scope="module")
def shared_engine(embedder_dir):
    from parallm_engine import get_engine

    return get_engine(embedder_dir, **ENGINE)


@pytest.fixture(scope="module")
def server(shared_engine, tmp_path_factory):
    pytest.importorskip("mlx_embeddings")
    from parallm_engine.serve.server import ServerThread

    bert = build_bert_encoder(tmp_path_factory.mktemp("bert") / "bert-tiny")
    with ServerThread(engine=shared_engine, api_key=KEY) as srv, \
            ServerThread(engine=shared_engine, api_key=KEY, embedding_model=str(bert)) as srv_bert:
        yield srv, srv_bert, str(bert)


# -- LangChain ------------------------------------------------------------------------------------
def test_langchain_in_process_shares_the_chat_engine(embedder_dir, shared_engine):
    from parallm_integrations import ChatParaLLM, ParaLLMEmbeddings

    emb = ParaLLMEmbeddings(model=embedder_dir, engine_kwargs=ENGINE)
    before = shared_engine.stats()["prefill_forwards"]
    docs = emb.embed_documents(DOCS)
    assert emb.client.engine() is shared_engine
    assert ChatParaLLM(model=embedder_dir, engine_kwargs=ENGINE)._get_engine() is shared_engine
    assert shared_engine.stats()["prefill_forwards"] - before < len(DOCS)  # one call's texts: batched
    assert close(docs, shared_engine.embed(DOCS))
    query = emb.embed_query("what is in the first passage?")
    assert cos(query, shared_engine.embed("what is in the first passage?", input_type="query")[0]) >= 0.9999
    assert close(asyncio.run(emb.aembed_documents(DOCS[:4])), docs[:4])
    assert cos(asyncio.run(emb.aembed_query("what is in the first passage?")), query) >= 0.9999
    assert emb.embed_documents([]) == []
    short = ParaLLMEmbeddings(model=embedder_dir, engine_kwargs=ENGINE, dimensions=8).embed_query("x")
    assert len(short) == 8


def test_langchain_chat_model_error_says_which_models_work(tiny_model_dir):
    from parallm_engine.errors import NotAnEmbeddingModelError
    from parallm_integrations import ParaLLMEmbeddings

    with pytest.raises(NotAnEmbeddingModelError, match="Qwen3-Embedding"):
        ParaLLMEmbeddings(model=str(tiny_model_dir)).embed_query("hello")
    v = ParaLLMEmbeddings(model=str(tiny_model_dir), pooling="mean").embed_query("hello")
    assert len(v) == 64


# -- LlamaIndex -----------------------------------------------------------------------------------
def test_llama_index_sync_async_batch(embedder_dir, shared_engine):
    from parallm_integrations.llama_index import ParaLLMEmbedding

    emb = ParaLLMEmbedding(model_name=embedder_dir, engine_kwargs=ENGINE)
    want = shared_engine.embed(DOCS)
    assert emb.embed_batch_size >= len(DOCS)
    assert close(emb.get_text_embedding_batch(DOCS), want)
    assert close([emb.get_text_embedding(DOCS[0])], want[:1])
    assert close(asyncio.run(emb.aget_text_embedding_batch(DOCS)), want)
    assert close([asyncio.run(emb.aget_text_embedding(DOCS[1]))], want[1:2])
    q = shared_engine.embed("where is Paris?", input_type="query")
    assert close([emb.get_query_embedding("where is Paris?")], q)
    assert close([asyncio.run(emb.aget_query_embedding("where is Paris?"))], q)
    assert close([emb.get_agg_embedding_from_queries(["where is Paris?"])], q)


# -- the server -----------------------------------------------------------------------------------
def test_server_embeddings_openai_shape(server, shared_engine):
    srv, _, _ = server
    client = OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0, timeout=120)
    resp = client.embeddings.create(model=shared_engine.model_name, input=DOCS[:5])
    assert [d.index for d in resp.data] == list(range(5)) and resp.object == "list"
    assert close([d.embedding for d in resp.data], shared_engine.embed(DOCS[:5]))
    ids = [shared_engine.encode(t) for t in DOCS[:5]]
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, ids))
    one = client.embeddings.create(input=DOCS[0], model=shared_engine.model_name)
    assert len(one.data) == 1 and cos(one.data[0].embedding, resp.data[0].embedding) >= 0.9999
    by_ids = client.embeddings.create(input=ids[:2], model=shared_engine.model_name)
    assert close([d.embedding for d in by_ids.data], [d.embedding for d in resp.data[:2]])
    single_ids = client.embeddings.create(input=ids[0], model=shared_engine.model_name)
    assert cos(single_ids.data[0].embedding, resp.data[0].embedding) >= 0.9999
    short = client.embeddings.create(input=DOCS[0], model=shared_engine.model_name, dimensions=16)
    v = np.asarray(resp.data[0].embedding[:16])
    np.testing.assert_allclose(short.data[0].embedding, v / np.linalg.norm(v), atol=1e-5)
    # base64: little-endian float32, as OpenAI's (the openai client decodes it back to floats)
    raw = client.embeddings.with_raw_response.create(input=DOCS[0], model=shared_engine.model_name,
                                                     encoding_format="base64").http_response.json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, resp.data[0].embedding, atol=1e-6)


def test_server_embedding_errors(server, shared_engine):
    import httpx

    srv, _, _ = server
    headers = {"Authorization": f"Bearer {KEY}"}

    def post(body):
        return httpx.post(srv.base_url + "/embeddings", json=body, headers=headers, timeout=60)

    for body, param in (({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [1.5]}, "input"),
                        ({"input": "x", "dimensions": 65}, "dimensions"), ({"input": {"a": 1}}, "input"),
                        ({"input": "word " * 5000}, "input"), ({"input": "x", "encoding_format": "int8"}, None)):
        r = post(body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
        if param:
            assert param in (r.json()["error"]["param"] or ""), r.json()
    assert post({"input": "word " * 5000}).json()["error"]["code"] == "context_length_exceeded"
    ok = post({"input": "word " * 5000, "truncate": True})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == shared_engine.context_window
    assert post({"input": "x", "model": "nope"}).status_code == 404
    assert httpx.post(srv.base_url + "/embeddings", json={"input": "x"}, timeout=60).status_code == 401


def test_server_embedding_model_and_base_url_clients(server):
    from parallm_engine import get_embedding_engine
    from parallm_integrations import ParaLLMEmbeddings
    from parallm_integrations.llama_index import ParaLLMEmbedding

    _, srv_bert, bert = server
    want = get_embedding_engine(bert).embed(DOCS[:4])
    lc = ParaLLMEmbeddings(model=bert, base_url=srv_bert.base_url, api_key=KEY, max_retries=0)
    assert close(lc.embed_documents(DOCS[:4]), want)
    assert close(asyncio.run(lc.aembed_documents(DOCS[:4])), want)
    assert close([lc.embed_query(DOCS[0])], want[:1])
    li = ParaLLMEmbedding(model_name=bert, base_url=srv_bert.base_url, api_key=KEY, max_retries=0)
    assert close(li.get_text_embedding_batch(DOCS[:4]), want)
    assert close(asyncio.run(li.aget_text_embedding_batch(DOCS[:4])), want)
    from parallm_engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        lc.embed_documents([""])
