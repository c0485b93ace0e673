"""Rerankers on the shared engine (``parallm_engine.embed.rerank*``, ``cross_encoder.py``), the LangChain /
LlamaIndex ``ParaLLMRerank`` classes and the server's rerank routes, on tiny random-weight models.

* Cross-encoder: a 2-layer ``BertForSequenceClassification`` (``tests.rerank_models``). torch is not
  installable here (so neither is sentence-transformers): the reference is an independent numpy
  implementation of transformers' BERT-for-sequence-classification forward, computed straight from the
  safetensors weights and the HF tokenizer's pair encoding, with sentence-transformers CrossEncoder's
  activation rule (sigmoid of the one logit unless the config names another).
* Decoder (Qwen3-Reranker): the card's prompt and formula computed with mlx-lm alone (``mlx_lm.load``, the
  model's last-position logits, softmax over "no" / "yes") on a tiny random qwen3.
* The server's routes through the real ``cohere`` client (``/v2/rerank``) and plain HTTP (``/v1/rerank``,
  ``/rerank``), hostile input answered with typed 4xx errors.

Run it on both paths: as is, and with ``PARALLM_BACKEND=cpu-mlx``.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from tests.rerank_models import (build_bert_cross_encoder, build_xlmr_cross_encoder, build_decoder_reranker, reference_cross_encoder,
                                 reference_decoder_scores)
from tests.test_server import assert_error_body

pytest.importorskip("mlx_embeddings")

ENGINE = {"decode_lanes": 1}
QUERY = "what is the capital of france?"
DOCS = ["paris is the capital of france.", "the cat sat on the mat", "blue green red " * 10, "a",
        "river mountain city sun moon", "where is the tallest mountain?", "the dog ran fast to the city"]


@pytest.fixture(scope="module")
def ce_dir(tmp_path_factory):
    return build_bert_cross_encoder(tmp_path_factory.mktemp("ce") / "tiny-bert-reranker")


@pytest.fixture(scope="module")
def ce_engine(ce_dir):
    from parallm_engine import CrossEncoderEngine, get_rerank_engine

    eng = get_rerank_engine(str(ce_dir))
    assert isinstance(eng, CrossEncoderEngine)
    return eng


@pytest.fixture(scope="module")
def dec_dir(tmp_path_factory):
    return build_decoder_reranker(tmp_path_factory.mktemp("dec") / "qwen3-reranker-tiny")


@pytest.fixture(scope="module")
def dec_engine(dec_dir):
    from parallm_engine import Engine, get_rerank_engine

    eng = get_rerank_engine(str(dec_dir), **ENGINE)
    assert type(eng) is Engine  # the chat engine of that model, shared
    return eng


def by_index(results) -> list[float]:
    return [r.relevance_score for r in sorted(results, key=lambda r: r.index)]


# -- cross-encoders ---------------------------------------------------------------------------------
def test_cross_encoder_equals_numpy_reference(ce_engine, ce_dir):
    results = ce_engine.rerank(QUERY, DOCS)
    assert [r.relevance_score for r in results] == sorted((r.relevance_score for r in results), reverse=True)
    assert sorted(r.index for r in results) == list(range(len(DOCS)))
    ref = reference_cross_encoder(ce_dir, QUERY, DOCS)
    np.testing.assert_allclose(by_index(results), ref, atol=1e-4, rtol=0)
    assert max(ref) - min(ref) > 0.05  # the scores differ enough for the comparison to mean something
    alone = [ce_engine.rerank(QUERY, [d])[0].relevance_score for d in DOCS]
    np.testing.assert_allclose(by_index(results), alone, atol=1e-6, rtol=0)  # batched (padded) == alone
    top = ce_engine.rerank(QUERY, DOCS, top_n=3)
    assert [r.index for r in top] == [r.index for r in results[:3]]
    tokens = ce_engine.tokenizer(QUERY, DOCS[0])["input_ids"]
    assert next(r for r in results if r.index == 0).tokens == len(tokens)


def test_xlm_roberta_cross_encoder_equals_numpy_reference(tmp_path):
    """bge-reranker's family: XLM-RoBERTa's positions (from the padding id + 1), its pair template and the
    RoBERTa classification head; padded in a batch (rows of different lengths) as alone."""
    from parallm_engine import get_rerank_engine

    path = build_xlmr_cross_encoder(tmp_path / "tiny-xlmr-reranker")
    eng = get_rerank_engine(str(path))
    try:
        assert eng.tokenizer(QUERY, DOCS[0])["input_ids"][:1] == [0]  # <s> ... </s></s> ... </s>
        results = eng.rerank(QUERY, DOCS)
        ref = reference_cross_encoder(path, QUERY, DOCS)
        np.testing.assert_allclose(by_index(results), ref, atol=1e-4, rtol=0)
        assert max(ref) - min(ref) > 0.05
        alone = [eng.rerank(QUERY, [d])[0].relevance_score for d in DOCS]
        np.testing.assert_allclose(by_index(results), alone, atol=1e-6, rtol=0)
    finally:
        eng.shutdown()


def test_cross_encoder_truncates_like_sentence_transformers(ce_engine, ce_dir):
    from parallm_engine.errors import ContextLengthExceededError

    long_doc = "the cat sat on the mat " * 40  # > 128 tokens with the query
    [r] = ce_engine.rerank(QUERY, [long_doc])
    assert r.truncated and r.tokens == 128
    assert abs(r.relevance_score - reference_cross_encoder(ce_dir, QUERY, [long_doc])[0]) < 1e-4
    with pytest.raises(ContextLengthExceededError):
        ce_engine.rerank(QUERY, [long_doc], truncate=False)


def test_cross_encoder_activation_from_config(tmp_path):
    from parallm_engine import get_rerank_engine
    from parallm_engine.errors import NotARerankerError

    ident = build_bert_cross_encoder(tmp_path / "ident-reranker", seed=1, config_extra={
        "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity", "version": "4.0.1"}})
    eng = get_rerank_engine(str(ident))
    assert eng.cross_head.activation == "Identity"
    scores = by_index(eng.rerank(QUERY, DOCS[:3]))
    np.testing.assert_allclose(scores, reference_cross_encoder(ident, QUERY, DOCS[:3]), atol=1e-4, rtol=0)
    assert any(s < 0 or s > 1 for s in scores)  # raw logits, not probabilities
    eng.shutdown()
    # A saved sentence-transformers 5 CrossEncoder: its config_sentence_transformers.json's activation wins
    (ident / "config_sentence_transformers.json").write_text(json.dumps(
        {"model_type": "CrossEncoder", "activation_fn": "torch.nn.modules.activation.Sigmoid"}))
    eng = get_rerank_engine(str(ident))
    assert eng.cross_head.activation == "Sigmoid"
    np.testing.assert_allclose(by_index(eng.rerank(QUERY, DOCS[:3])), 1 / (1 + np.exp(-np.array(scores))),
                               atol=1e-6, rtol=0)
    eng.shutdown()
    legacy = build_bert_cross_encoder(tmp_path / "legacy-reranker", seed=1, config_extra={
        "sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"})
    eng = get_rerank_engine(str(legacy))
    np.testing.assert_allclose(by_index(eng.rerank(QUERY, DOCS[:3])), scores, atol=1e-6, rtol=0)
    eng.shutdown()
    with pytest.raises(NotARerankerError, match="2 labels"):
        get_rerank_engine(str(build_bert_cross_encoder(tmp_path / "nli", num_labels=2)))


def test_models_that_do_not_rerank(ce_engine, tiny_model_dir, tmp_path):
    from parallm_engine import get_rerank_engine
    from parallm_engine.errors import NotAnEmbeddingModelError, NotARerankerError
    from tests.embedding_models import build_bert_encoder

    with pytest.raises(NotARerankerError, match="embedding encoder"):
        get_rerank_engine(str(build_bert_encoder(tmp_path / "bert-embedder")))
    with pytest.raises(NotARerankerError, match="do not say reranker"):  # a chat model: refused before loading
        get_rerank_engine(str(tiny_model_dir))
    with pytest.raises(NotARerankerError, match="sequence-classification"):
        get_rerank_engine(str(tiny_model_dir), kind="cross-encoder")
    with pytest.raises(NotARerankerError):
        ce_engine.rerank(QUERY, DOCS, kind="decoder")
    with pytest.raises(NotAnEmbeddingModelError, match="cross-encoder"):
        ce_engine.embed("a text")
    from parallm_engine import get_embedding_engine

    with pytest.raises(NotAnEmbeddingModelError, match="cross-encoder"):
        get_embedding_engine(ce_engine.model_info.source)


@pytest.mark.parametrize("args", [
    {"query": "", "documents": DOCS}, {"query": 3, "documents": DOCS}, {"query": QUERY, "documents": []},
    {"query": QUERY, "documents": "one string"}, {"query": QUERY, "documents": [1, 2]},
    {"query": QUERY, "documents": DOCS, "top_n": 0}, {"query": QUERY, "documents": DOCS, "top_n": "2"},
    {"query": QUERY, "documents": DOCS, "top_n": True}, {"query": "\ud800", "documents": DOCS},
    {"query": QUERY, "documents": DOCS, "kind": "bi-encoder"},
])
def test_bad_arguments_are_typed_errors(ce_engine, args):
    from parallm_engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        ce_engine.rerank(**args)


# -- decoder rerankers ------------------------------------------------------------------------------
def test_decoder_equals_mlx_lm_reference(dec_engine, dec_dir):
    results = dec_engine.rerank(QUERY, DOCS)
    prompt = dec_engine._decoder_prompt()
    ids = [dec_engine._rerank_pair(QUERY, d, None, True)[0] for d in DOCS]
    ref = reference_decoder_scores(dec_dir, ids, prompt.yes, prompt.no)
    np.testing.assert_allclose(by_index(results), ref, atol=1e-4, rtol=0)
    assert max(ref) - min(ref) > 0.05
    assert [r.tokens for r in sorted(results, key=lambda r: r.index)] == [len(i) for i in ids]
    alone = [dec_engine.rerank(QUERY, [d])[0].relevance_score for d in DOCS]
    np.testing.assert_allclose(by_index(results), alone, atol=1e-5, rtol=0)
    # the card's prompt: system turn, instruction / query / document, an empty thinking block
    text = dec_engine.tokenizer.decode(ids[0])
    assert text.startswith("<|im_start|>system\nJudge whether the Document meets the requirements")
    assert "<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n<Query>: " \
        f"{QUERY}\n<Document>: {DOCS[0]}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n" in text
    custom = dec_engine.rerank(QUERY, DOCS[:2], instruction="Find passages about cities")
    ids = [dec_engine._rerank_pair(QUERY, d, "Find passages about cities", True)[0] for d in DOCS[:2]]
    np.testing.assert_allclose(by_index(custom), reference_decoder_scores(dec_dir, ids, prompt.yes, prompt.no),
                               atol=1e-4, rtol=0)


def test_decoder_shared_prefix_is_computed_once(dec_engine):
    from tests.conftest import settled_stats

    query = "which passage names the river of the capital city?"  # not seen before: its prefix is not cached
    docs = [f"passage {i}: the {' '.join(['river', 'sun', 'moon', 'star'][: 1 + i % 4])} of city {i}"
            for i in range(64)]
    ids = [dec_engine._rerank_pair(query, d, None, True)[0] for d in docs]
    common = next(i for i in range(min(map(len, ids))) if len({x[i] for x in ids}) > 1)
    assert common > 60
    before = settled_stats(dec_engine)["prefill_tokens"]
    results = dec_engine.rerank(query, docs)
    computed = settled_stats(dec_engine)["prefill_tokens"] - before
    total = sum(map(len, ids))
    # Every pair's own tokens, plus the shared prefix once: the other 63 read it from the prefix cache
    # (give or take the last partly filled page of the prefix, which a row may recompute).
    assert sum(r.cached_tokens for r in results) >= 63 * (common - 16)
    assert computed + len(docs) == total - sum(r.cached_tokens for r in results)  # + one answer position each
    assert computed <= total - 63 * (common - 16)
    alone = [dec_engine.rerank(query, [d])[0].relevance_score for d in docs[:8]]
    np.testing.assert_allclose(by_index(results)[:8], alone, atol=1e-5)


def test_decoder_beside_chat_and_the_kind_rule(dec_engine, tiny_model_dir):
    from parallm_engine import get_engine
    from parallm_engine.errors import NotARerankerError

    want = by_index(dec_engine.rerank(QUERY, DOCS))
    [alone] = dec_engine.generate("hello there", max_tokens=12, temperature=0)

    async def both():
        chat = dec_engine.agenerate("hello there", max_tokens=12, temperature=0)
        return await asyncio.gather(chat, dec_engine.arerank(QUERY, DOCS))

    [chat], results = asyncio.run(both())
    assert chat.token_ids == alone.token_ids  # a rerank batch beside a chat stream changes none of its tokens
    np.testing.assert_allclose(by_index(results), want, atol=1e-5)
    chat_engine = get_engine(str(tiny_model_dir))
    with pytest.raises(NotARerankerError, match="kind='decoder'"):
        chat_engine.rerank(QUERY, DOCS)
    forced = chat_engine.rerank(QUERY, DOCS[:2], kind="decoder")  # any causal LM with yes / no tokens
    assert len(forced) == 2 and all(0 <= r.relevance_score <= 1 for r in forced)
    with pytest.raises(NotARerankerError):
        dec_engine.rerank(QUERY, DOCS, kind="cross-encoder")


# -- LangChain and LlamaIndex -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def bert_embedder(tmp_path_factory):
    from tests.embedding_models import build_bert_encoder

    return str(build_bert_encoder(tmp_path_factory.mktemp("emb") / "bert-embedder"))


def test_langchain_contextual_compression_retriever(ce_engine, ce_dir, dec_engine, dec_dir, bert_embedder):
    from langchain_classic.retrievers import ContextualCompressionRetriever
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore

    from parallm_integrations import ParaLLMEmbeddings, ParaLLMRerank

    store = InMemoryVectorStore.from_documents([Document(d, metadata={"n": i}) for i, d in enumerate(DOCS)],
                                               ParaLLMEmbeddings(model=bert_embedder))
    base = store.as_retriever(search_kwargs={"k": len(DOCS)})
    for model, engine, kwargs in ((str(ce_dir), ce_engine, {}), (str(dec_dir), dec_engine, ENGINE)):
        rerank = ParaLLMRerank(model=model, top_n=3, engine_kwargs=kwargs)
        retriever = ContextualCompressionRetriever(base_compressor=rerank, base_retriever=base)
        got = retriever.invoke(QUERY)
        assert rerank.client.engine() is engine
        want = engine.rerank(QUERY, DOCS, top_n=3)
        assert [d.metadata["n"] for d in got] == [r.index for r in want]
        np.testing.assert_allclose([d.metadata["relevance_score"] for d in got],
                                   [r.relevance_score for r in want], atol=1e-5)
        agot = asyncio.run(retriever.ainvoke(QUERY))
        assert [d.metadata["n"] for d in agot] == [d.metadata["n"] for d in got]
    assert ParaLLMRerank(model=str(ce_dir), top_n=2).compress_documents([], QUERY) == []
    with pytest.raises(ValueError):
        ParaLLMRerank(model=str(ce_dir), top_k=2)  # an unknown argument is an error


def test_llama_index_query_engine_with_the_postprocessor(ce_engine, ce_dir, bert_embedder):
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.llms import MockLLM

    from parallm_integrations.llama_index import ParaLLMEmbedding, ParaLLMRerank

    index = VectorStoreIndex.from_documents([Document(text=d) for d in DOCS],
                                            embed_model=ParaLLMEmbedding(model=bert_embedder))
    post = ParaLLMRerank(model=str(ce_dir), top_n=2)
    engine = index.as_query_engine(llm=MockLLM(max_tokens=8), similarity_top_k=len(DOCS), node_postprocessors=[post])
    want = ce_engine.rerank(QUERY, DOCS, top_n=2)
    for response in (engine.query(QUERY), asyncio.run(engine.aquery(QUERY))):
        nodes = response.source_nodes
        assert [n.node.get_content() for n in nodes] == [DOCS[r.index].strip() for r in want]  # the parser strips
        np.testing.assert_allclose([n.score for n in nodes], [r.relevance_score for r in want], atol=1e-5)


# -- the server -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tiny_engine, dec_engine, ce_dir):
    from parallm_engine.serve.server import ServerThread

    with ServerThread(engine=tiny_engine, rerank_model=str(ce_dir)) as srv_ce, \
            ServerThread(engine=dec_engine) as srv_dec:
        yield srv_ce, srv_dec


def test_cohere_client_against_v2_rerank(servers, ce_engine, ce_dir):
    import cohere

    srv_ce, _ = servers
    client = cohere.ClientV2(base_url=srv_ce.url, api_key="unused")
    resp = client.rerank(model=str(ce_dir), query=QUERY, documents=DOCS, top_n=3)
    want = ce_engine.rerank(QUERY, DOCS, top_n=3)
    assert [r.index for r in resp.results] == [r.index for r in want]
    np.testing.assert_allclose([r.relevance_score for r in resp.results], [r.relevance_score for r in want],
                               atol=1e-5)
    assert resp.meta.tokens.input_tokens == sum(r.tokens for r in ce_engine.rerank(QUERY, DOCS))


def test_v1_rerank_and_jina_route(servers, ce_engine, dec_engine, dec_dir):
    srv_ce, srv_dec = servers
    for url, engine in ((srv_ce.url, ce_engine), (srv_dec.url, dec_engine)):
        want = engine.rerank(QUERY, DOCS)
        for route in ("/v1/rerank", "/rerank"):
            body = httpx.post(url + route, json={"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                                 "top_n": 100, "return_documents": True}, timeout=60).json()
            assert [r["index"] for r in body["results"]] == [r.index for r in want]
            assert [r["document"]["text"] for r in body["results"]] == [DOCS[r.index] for r in want]
            np.testing.assert_allclose([r["relevance_score"] for r in body["results"]],
                                       [r.relevance_score for r in want], atol=1e-5)
            assert body["usage"]["total_tokens"] == sum(r.tokens for r in want)


def test_remote_classes_equal_in_process(servers, ce_dir, ce_engine):
    from langchain_core.documents import Document

    from parallm_integrations import ParaLLMRerank

    srv_ce, _ = servers
    local = ParaLLMRerank(model=str(ce_dir), top_n=4).compress_documents([Document(d) for d in DOCS], QUERY)
    remote_cls = ParaLLMRerank(model=str(ce_dir), top_n=4, base_url=srv_ce.base_url, api_key="unused")
    remote = remote_cls.compress_documents([Document(d) for d in DOCS], QUERY)
    assert [d.page_content for d in remote] == [d.page_content for d in local]
    np.testing.assert_allclose([d.metadata["relevance_score"] for d in remote],
                               [d.metadata["relevance_score"] for d in local], atol=1e-5)
    aremote = asyncio.run(remote_cls.acompress_documents([Document(d) for d in DOCS], QUERY))
    assert [d.page_content for d in aremote] == [d.page_content for d in local]


@pytest.mark.parametrize("body, param", [
    ({"query": 3, "documents": DOCS}, None), ({"query": QUERY, "documents": "text"}, None),
    ({"query": QUERY, "documents": [1, 2]}, None), ({"query": QUERY, "documents": [{"txt": "a"}]}, None),
    ({"query": QUERY, "documents": []}, "documents"), ({"query": "", "documents": DOCS}, "query"),
    ({"query": QUERY, "documents": DOCS, "top_n": 10 ** 20}, None),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, None),
    ({"query": QUERY, "documents": DOCS, "top_n": "3"}, None),
    ({"query": QUERY, "documents": DOCS, "return_documents": "yes"}, None),
    ({"query": QUERY, "documents": DOCS, "unknown_field": 1}, None),
    ({"query": QUERY, "documents": ["a"] * 1001}, "documents"),
    ({"documents": DOCS}, None),
])
@pytest.mark.parametrize("route", ["/v1/rerank", "/v2/rerank"])
def test_hostile_input_gets_typed_4xx(servers, body, param, route):
    srv_ce, _ = servers
    resp = httpx.post(srv_ce.url + route, json=body, timeout=60)
    err = assert_error_body(resp, 400, param=param)
    assert err["type"] == "invalid_request_error"


def test_hostile_context_and_model_errors(servers):
    srv_ce, srv_dec = servers
    long_doc = "the cat sat on the mat " * 40
    resp = httpx.post(srv_ce.url + "/v1/rerank", json={"query": QUERY, "documents": [long_doc], "truncate": False},
                      timeout=60)
    assert_error_body(resp, 400, code="context_length_exceeded")
    resp = httpx.post(srv_ce.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS, "model": "nope"}, timeout=60)
    assert_error_body(resp, 404, code="model_not_found")
    resp = httpx.post(srv_ce.url + "/v1/rerank", content='{"query": "q", "documents": ["\\ud800 lone"]}',
                      headers={"Content-Type": "application/json"}, timeout=60)  # a lone surrogate, as JSON allows
    assert_error_body(resp, 400)
    # a chat model served without --rerank-model: NotARerankerError, a 400
    from parallm_engine.serve.server import ServerThread

    with ServerThread(engine=srv_ce.app.state.parallm.engine) as plain:
        resp = httpx.post(plain.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60)
        err = assert_error_body(resp, 400, param="model")
        assert "not a reranker" in err["message"]


def test_cli_has_the_flag():
    from parallm_engine.cli import build_parser

    args = build_parser().parse_args(["serve", "--rerank-model", "BAAI/bge-reranker-base"])
    assert args.rerank_model == "BAAI/bge-reranker-base"


def test_bench_rerank_workload_quick():
    """`parallm bench --workloads rerank --quick` end to end (its timings are not checked: no timing asserts):
    every pair scored, and the pairs' shared prefix not recomputed for each."""
    from parallm_bench import bench
    from parallm_bench import rerank as bench_rerank

    entry = bench_rerank.run_rerank({**bench_rerank.QUICK_RERANK, "docs": 8})
    assert entry["parallm"]["pairs"] == entry["sequential"]["pairs"] == 8
    assert entry["shared_prefix_tokens"] > 20
    # the shared prefix is computed once (not 8 times): at least 7 of its 8 copies were not recomputed
    assert entry["parallm"]["prefill_tokens"] <= entry["parallm"]["pair_tokens"] - 7 * entry["shared_prefix_tokens"] + 8
    lines = bench_rerank.format_lines(entry)
    assert "rerank" in bench.ALL_WORKLOADS and any("not recomputed" in ln for ln in lines)
