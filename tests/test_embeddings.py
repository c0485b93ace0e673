"""Embeddings on the shared engine (``parallm_engine.embed.embedding``): tiny random-weight models, real forwards.

A qwen3 decoder with Qwen3-Embedding's sentence-transformers files runs through the scheduler's prefill
(embedding rows next to chat prompts); a 2-layer BERT runs through mlx-embeddings (``EncoderEngine``).
Vectors batched equal vectors alone and equal the model's own forward; chat streams decoding beside 64
embedding texts produce the tokens they produce alone.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.embedding_models import (QUERY_PROMPT, build_bert_encoder, build_decoder_embedder, reference_bert,
                                    reference_decoder)

TEXTS = ["hello world", "the cat sat on the mat", "Paris is the capital of France.", "a",
         "embedding rows ride in the prefill " * 12, "what is the tallest mountain?", "blue green red " * 30,
         "one more short text"]


def cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory):
    return build_decoder_embedder(tmp_path_factory.mktemp("emb") / "qwen3-embedding-tiny")


@pytest.fixture(scope="module")
def emb_engine(embedder_dir):
    from parallm_engine import Engine

    # chunk 64: the long texts above are prefilled chunk by chunk, the short ones in groups
    eng = Engine(str(embedder_dir), max_batch_size=16, prefill_chunk=64, prefill_budget=256, decode_lanes=1)
    yield eng
    eng.shutdown()


def test_config_from_sentence_transformers_files(emb_engine):
    cfg = emb_engine.embedding_config()
    assert (cfg.pooling, cfg.normalize, cfg.dimensions, cfg.matryoshka) == ("last", True, 64, True)
    assert cfg.query_prompt == QUERY_PROMPT and cfg.source.endswith("modules.json")


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_batched_equals_alone_equals_reference(emb_engine, embedder_dir, pooling):
    batched = emb_engine.embed(TEXTS, pooling=pooling)
    alone = [emb_engine.embed(t, pooling=pooling)[0] for t in TEXTS]
    ids = [emb_engine.encode(t) for t in TEXTS]
    assert any(len(i) > 64 for i in ids) and any(len(i) < 8 for i in ids)  # chunked and grouped rows
    ref = reference_decoder(embedder_dir, ids, pooling)
    for b, a, r in zip(batched, alone, ref):
        assert len(b) == 64 and abs(np.linalg.norm(b) - 1) < 1e-5
        assert cos(b, a) >= 0.9999 and cos(b, r) >= 0.9999
        np.testing.assert_allclose(b, r, atol=1e-4)


def test_query_prompt_instruction_and_token_ids(emb_engine, embedder_dir):
    q = "what is the capital of France?"
    [with_prompt] = emb_engine.embed(q, input_type="query")
    ref = reference_decoder(embedder_dir, [emb_engine.encode(QUERY_PROMPT + q)])[0]
    assert cos(with_prompt, ref) >= 0.9999
    [instructed] = emb_engine.embed(q, input_type="query", instruction="Find the city")
    ref = reference_decoder(embedder_dir, [emb_engine.encode("Instruct: Find the city\nQuery: " + q)])[0]
    assert cos(instructed, ref) >= 0.9999
    [doc] = emb_engine.embed(q, input_type="document")  # document prompt is "" for this model
    [from_ids] = emb_engine.embed([emb_engine.encode(q)])
    assert cos(doc, from_ids) >= 0.9999 and cos(doc, with_prompt) < 0.9999


def test_matryoshka_dimensions(emb_engine):
    [full] = emb_engine.embed("the cat sat on the mat")
    [short] = emb_engine.embed("the cat sat on the mat", dimensions=16)
    want = np.asarray(full[:16]) / np.linalg.norm(full[:16])
    np.testing.assert_allclose(short, want, atol=1e-5)


def test_bad_input_is_refused_and_engine_keeps_serving(emb_engine):
    from parallm_engine.errors import ContextLengthExceededError, InvalidRequestError

    for bad in ("", None, 3.5, [1.5, 2], [], [-1], {"text": "x"}):
        with pytest.raises(InvalidRequestError):
            emb_engine.embed([bad])
    with pytest.raises(InvalidRequestError):
        emb_engine.embed(42)
    with pytest.raises(InvalidRequestError, match="pooling"):
        emb_engine.embed("x", pooling="max")
    with pytest.raises(InvalidRequestError, match="dimensions"):
        emb_engine.embed("x", dimensions=65)
    with pytest.raises(InvalidRequestError, match="input_type"):
        emb_engine.embed("x", input_type="passage")
    long_text = "word " * (emb_engine.context_window + 10)
    with pytest.raises(ContextLengthExceededError, match="truncate=True"):
        emb_engine.embed(long_text)
    [res] = emb_engine.embed_results(long_text, truncate=True)
    assert res.truncated and res.prompt_tokens == emb_engine.context_window
    assert len(emb_engine.embed("still serving")[0]) == 64


def test_chat_model_without_embedding_config_says_which_models_work(tiny_engine):
    from parallm_engine.errors import NotAnEmbeddingModelError

    with pytest.raises(NotAnEmbeddingModelError, match="Qwen3-Embedding.*pooling="):
        tiny_engine.embed("hello")
    [v] = tiny_engine.embed("hello", pooling="mean")  # the caller's pooling: any decoder embeds
    assert len(v) == 64 and abs(np.linalg.norm(v) - 1) < 1e-5
    with pytest.raises(InvalidRequestErrorType(), match="Matryoshka"):
        tiny_engine.embed("hello", pooling="mean", dimensions=8)


def InvalidRequestErrorType():
    from parallm_engine.errors import InvalidRequestError

    return InvalidRequestError


def test_embeddings_keep_no_kv(emb_engine):
    emb_engine.clear_prefix_cache()
    emb_engine.embed(TEXTS)
    mem = emb_engine.stats()["memory"]
    assert mem["kv_bytes_prefix_cache"] == 0 and mem["kv_bytes_running"] == 0
    stats = emb_engine.stats()
    assert stats["in_flight"] == 0 and stats["embeddings_finished"] >= len(TEXTS)


def test_cancel_one_embedding(emb_engine):
    from parallm_engine.errors import RequestCancelledError

    handles = [emb_engine.submit_embedding(t) for t in TEXTS * 4]
    handles[-1].abort()
    with pytest.raises(RequestCancelledError):
        handles[-1].result()
    alone = emb_engine.embed(TEXTS[0])[0]
    assert cos(handles[0].result().embedding, alone) >= 0.9999
    for h in handles[1:-1]:
        assert len(h.result().embedding) == 64
    assert emb_engine.stats()["in_flight"] == 0


def test_aembed_on_the_callers_loop(emb_engine):
    got = asyncio.run(emb_engine.aembed(TEXTS[:3]))
    want = emb_engine.embed(TEXTS[:3])
    assert all(cos(a, b) >= 0.9999 for a, b in zip(got, want))


def test_64_texts_beside_8_decoding_chat_streams(emb_engine):
    from tests.model_zoo import prompt_ids

    vocab = emb_engine.model_info.vocab_size
    prompts = [prompt_ids(10 + 3 * i, vocab, seed=i) for i in range(8)]
    opts = dict(temperature=0.0, max_tokens=48, ignore_eos=True)
    solo_tokens = [emb_engine.generate([p], **opts)[0].token_ids for p in prompts]
    texts = [f"text number {i}: " + "the cat sat on the mat " * (1 + i % 7) for i in range(64)]
    solo_vecs = [emb_engine.embed(t)[0] for t in texts]

    chats = [emb_engine.submit(p, **opts) for p in prompts]
    streams = [iter(h) for h in chats]
    firsts = [next(s) for s in streams]  # every chat stream is decoding now
    assert all(not h.request.finished for h in chats)
    before = emb_engine.stats()["prefill_forwards"]
    vecs = emb_engine.embed(texts)
    tokens = [f.token_ids + [t for d in s for t in d.token_ids] for f, s in zip(firsts, streams)]
    assert tokens == solo_tokens
    assert all(cos(v, s) >= 0.9999 for v, s in zip(vecs, solo_vecs))
    # 64 texts in far fewer forwards than one each: they were batched
    assert emb_engine.stats()["prefill_forwards"] - before < 64


def test_cpu_mlx_backend_gives_the_same_vectors(embedder_dir, emb_engine):
    from parallm_engine import Engine

    eng = Engine(str(embedder_dir), backend="cpu-mlx", max_batch_size=16, prefill_chunk=64, decode_lanes=1)
    try:
        got = eng.embed(TEXTS)
    finally:
        eng.shutdown()
    want = emb_engine.embed(TEXTS)
    assert all(cos(a, b) >= 0.9999 for a, b in zip(got, want))


# -- encoder models through mlx-embeddings ----------------------------------------------------------
@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    pytest.importorskip("mlx_embeddings")
    return build_bert_encoder(tmp_path_factory.mktemp("bert") / "bert-tiny")


@pytest.fixture(scope="module")
def bert_engine(bert_dir):
    from parallm_engine import get_embedding_engine

    return get_embedding_engine(str(bert_dir))


BERT_TEXTS = ["the cat sat on the mat", "what is the capital of france?", "apple", "blue river " * 20,
              "where is the sun?", "a red apple and a green pear"]


def test_bert_batched_equals_alone_equals_mlx_embeddings(bert_engine, bert_dir):
    from parallm_engine import EncoderEngine, get_embedding_engine

    assert isinstance(bert_engine, EncoderEngine) and get_embedding_engine(str(bert_dir)) is bert_engine
    cfg = bert_engine.embedding_config()
    assert (cfg.pooling, cfg.normalize) == ("mean", True)
    batched = bert_engine.embed(BERT_TEXTS)
    alone = [bert_engine.embed(t)[0] for t in BERT_TEXTS]
    ref = reference_bert(bert_dir, BERT_TEXTS)
    for b, a, r in zip(batched, alone, ref):
        assert cos(b, a) >= 0.9999 and cos(b, r) >= 0.9999
        np.testing.assert_allclose(b, r, atol=1e-4)
    cls = bert_engine.embed(BERT_TEXTS[0], pooling="cls", normalize=False)[0]
    assert len(cls) == 64 and abs(np.linalg.norm(cls) - 1) > 1e-3


def test_bert_bad_input_cancel_and_async(bert_engine):
    from parallm_engine.errors import ContextLengthExceededError, InvalidRequestError, RequestCancelledError

    with pytest.raises(InvalidRequestError):
        bert_engine.embed([""])
    with pytest.raises(ContextLengthExceededError):
        bert_engine.embed("apple " * 200)
    [r] = bert_engine.embed_results("apple " * 200, truncate=True)
    assert r.truncated and r.prompt_tokens == bert_engine.context_window
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        bert_engine.embed("apple", dimensions=8)
    handles = [bert_engine.submit_embedding(t) for t in BERT_TEXTS * 20]
    handles[-1].abort()
    for h in handles[:-1]:
        assert len(h.result().embedding) == 64
    if not handles[-1].request.result:  # aborted before its batch started
        with pytest.raises(RequestCancelledError):
            handles[-1].result()
    got = asyncio.run(bert_engine.aembed(BERT_TEXTS))
    assert all(cos(a, b) >= 0.9999 for a, b in zip(got, bert_engine.embed(BERT_TEXTS)))
    assert bert_engine.stats()["in_flight"] == 0


def test_mixed_layout_decoder_embeds_chunk_by_chunk(tmp_path):
    """A sliding-window family (gemma3_text: cache layout "mixed") prefills every text through its own
    mlx-lm caches, chunk by chunk: the pooled vector still equals the model's own forward."""
    from parallm_engine import Engine
    from tests.model_zoo import build, default_tokenizer

    tok_dir, vocab = default_tokenizer()
    path = build("gemma3_text", tmp_path / "g3", tok_dir, vocab, verify=False)
    eng = Engine(str(path), max_batch_size=8, prefill_chunk=16, decode_lanes=1)
    try:
        assert eng._scheduler.layout == "mixed"
        texts = TEXTS[:5]
        ids = [eng.encode(t) for t in texts]
        for pooling in ("last", "mean"):
            got = eng.embed(texts, pooling=pooling)
            ref = reference_decoder(path, ids, pooling)
            assert all(cos(a, b) >= 0.9999 for a, b in zip(got, ref))
    finally:
        eng.shutdown()


def test_bidirectional_embedder_is_refused(tmp_path, embedder_dir):
    import json
    import shutil

    from parallm_engine import Engine
    from parallm_engine.errors import NotAnEmbeddingModelError

    path = tmp_path / "bidirectional"
    shutil.copytree(embedder_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "use_bidirectional_attention": True}))
    eng = Engine(str(path), decode_lanes=1)
    try:
        with pytest.raises(NotAnEmbeddingModelError, match="bidirectional"):
            eng.embed("hello")
    finally:
        eng.shutdown()


def test_bench_embed_workload_quick():
    """`parallm bench --workloads embed --quick` end to end (its numbers are not checked: no timing asserts)."""
    from parallm_bench import bench
    from parallm_bench import embed as bench_embed

    sizes = {**bench_embed.QUICK_EMBED, "texts": 16, "new_tokens": 4, "burst": 40}
    entry = bench_embed.run_embed(sizes)
    assert entry["sequential"]["texts"] == 16
    assert all(entry[f"parallm_c{c}"]["texts"] == 16 for c in bench_embed.CONCURRENCY)
    beside = entry["beside_generation"]
    assert beside["texts"] == 40 and beside["itl_p50_alone_ms"] > 0 and beside["itl_p50_during_ms"] > 0
    lines = bench_embed.format_lines(entry)
    assert "embed" in bench.ALL_WORKLOADS and any("beside 8 decoding chat streams" in ln for ln in lines)


@pytest.mark.parametrize("backend", [None, "cpu-mlx"])
def test_an_embedding_row_beside_an_adapter_row_in_one_prefill_forward(embedder_dir, tmp_path, backend):
    """An embedding text and a chat prompt under a LoRA adapter in one prefill forward (``runner.forward``
    binds every row's adapter, the embedding rows' hidden states included): the prompt is computed under
    its adapter (mlx-lm with that adapter loaded gives the same greedy tokens), and the vector is the one
    the text gets alone."""
    import json
    import threading

    from mlx_lm import load

    from parallm_bench.lora import write_random_adapter
    from parallm_engine import Engine
    from tests.model_zoo import prompt_ids, reference_greedy

    adapter = write_random_adapter(embedder_dir, tmp_path / "adapter", rank=4, seed=5)
    vocab = json.loads((embedder_dir / "config.json").read_text())["vocab_size"]
    prompt = prompt_ids(30, vocab, seed=3)
    want = reference_greedy(load(str(embedder_dir), adapter_path=str(adapter))[0], prompt, 8)
    assert want != reference_greedy(load(str(embedder_dir))[0], prompt, 8)  # the adapter changes the answer
    eng = Engine(str(embedder_dir), adapters={"a": str(adapter)}, backend=backend, decode_lanes=1,
                 prefill_chunk=128)
    try:
        text = "the cat sat on the mat and the dog ran fast"
        [alone] = eng.embed(text)
        forwards = eng.stats()["prefill_forwards"]
        release, held = threading.Event(), threading.Event()
        holder = threading.Thread(target=eng.run_on_engine_thread, args=(lambda: (held.set(), release.wait(30)),))
        holder.start()
        assert held.wait(30)
        vector = eng.submit_embedding(text)
        chat = eng.submit(prompt, adapter="a", max_tokens=8, temperature=0, ignore_eos=True)
        release.set()
        holder.join()
        assert eng._collect(chat).token_ids == want
        together = vector.result().embedding
        assert eng.stats()["prefill_forwards"] - forwards == 1  # one forward held both rows
        assert cos(together, alone) > 0.99999
    finally:
        eng.shutdown()
