"""Embeddings at RAG scale (issue 62): LangChain ``ParaLLMEmbeddings`` and LlamaIndex ``ParaLLMEmbedding`` take any
number of texts (chunked under the engine's queue bound, or a server's per-request limit), in order, with the
vectors small batches give; a full queue makes a large batch wait, and a large batch leaves room for other
callers. On a tiny random-weight qwen3 "Qwen3-Embedding" (``tests.embedding_models``)."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest

from tests.embedding_models import WORDS, build_decoder_embedder

ENGINE = {"decode_lanes": 1}
SMALL_QUEUE = {"decode_lanes": 1, "max_queue": 32}  # a quarter: 8 texts of waiting batches in flight
KEY = "scale-key"


def corpus(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct short chunks (2-12 words), in no order of length."""
    rng = random.Random(seed)
    return [f"chunk {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) for i in range(n)]


def small_batches(engine, texts: list[str], size: int = 16) -> np.ndarray:
    out: list = []
    for i in range(0, len(texts), size):
        out += engine.embed(texts[i : i + size])
    return np.asarray(out)


def run_in_thread(fn):
    """Start ``fn`` in a thread; returns (thread, box): ``box`` gets ``value`` or ``error``."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001  (reported by the test)
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory):
    return str(build_decoder_embedder(tmp_path_factory.mktemp("emb-scale") / "qwen3-embedding-tiny"))


@pytest.fixture(scope="module")
def shared_engine(embedder_dir):
    from parallm_engine import get_engine

    return get_engine(embedder_dir, **ENGINE)


@pytest.fixture(scope="module")
def small_engine(embedder_dir):
    """The shared engine for the same model with a 32-request queue (its own: the settings differ)."""
    from parallm_engine import get_engine

    return get_engine(embedder_dir, **SMALL_QUEUE)


@pytest.fixture(scope="module")
def texts():
    return corpus(10_000)


# -- LangChain ------------------------------------------------------------------------------------
def test_10000_texts_equal_small_batches_in_order(embedder_dir, shared_engine, texts, capsys):
    from parallm_integrations import ParaLLMEmbeddings

    emb = ParaLLMEmbeddings(model=embedder_dir, engine_kwargs=ENGINE)
    assert len(texts) > shared_engine.max_queue  # all at once would be refused (QueueFullError)
    shared_engine.reset_peaks()
    got = np.asarray(emb.embed_documents(texts))
    assert emb.client.engine() is shared_engine
    assert shared_engine.stats()["peak_in_flight"] <= shared_engine.max_queue // 4
    assert "10000/10000" in capsys.readouterr().err  # a progress bar on a long run...
    want = small_batches(shared_engine, texts)
    assert got.shape == (10_000, 64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    emb.embed_documents(texts[:50])
    assert "Embedding" not in capsys.readouterr().err  # ...and none on a short one
    got_async = np.asarray(asyncio.run(emb.aembed_documents(texts)))
    np.testing.assert_allclose(got_async, want, rtol=0, atol=1e-6)
    assert "10000/10000" in capsys.readouterr().err
    quiet = ParaLLMEmbeddings(model=embedder_dir, engine_kwargs=ENGINE, show_progress_bar=False)
    np.testing.assert_allclose(quiet.embed_documents(texts[:1500]), want[:1500], rtol=0, atol=1e-6)
    assert "Embedding" not in capsys.readouterr().err


def test_length_sorted_submission_pads_less_and_gives_the_same_vectors(shared_engine, monkeypatch):
    """A call's texts are queued shortest first, so a forward (its rows padded to the longest) holds texts of
    similar length; the vectors are the ones each text gets in its own small batch."""
    from parallm_engine.runner import forward

    rng = random.Random(1)
    mixed = [" ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 3, 60, 90]))) for _ in range(400)]
    want = small_batches(shared_engine, mixed, size=1)
    seen = {"computed": 0, "tokens": 0}
    real = forward.texts

    def counting(model, tokens, seqs, lengths):  # the real forward (whole texts, no KV), its padded shape counted
        seen["computed"] += tokens.shape[0] * tokens.shape[1]
        seen["tokens"] += sum(lengths)
        return real(model, tokens, seqs, lengths)

    monkeypatch.setattr(forward, "texts", counting)
    got = np.asarray(shared_engine.embed(mixed))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # queued in input order, this mix computes about twice its tokens (padding); sorted, about 1.2x
    assert seen["tokens"] == sum(len(shared_engine.encode(t)) for t in mixed)
    assert seen["computed"] < 1.5 * seen["tokens"]


def test_texts_of_separate_calls_are_grouped_by_length(shared_engine, monkeypatch):
    """Texts of many separate calls (as concurrent ``aembed`` callers send them: one text each, in no order of
    length) queue together; a forward takes texts of similar length (at least ``EMBEDDING_FILL`` of its padded
    rectangle real tokens), the others wait for a forward of their own, and every vector is the one its text
    gets alone."""
    from parallm_engine.core.prefill_planner import EMBEDDING_FILL
    from parallm_engine.runner import forward

    rng = random.Random(2)
    mixed = [" ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 3, 60, 90]))) for _ in range(96)]
    want = small_batches(shared_engine, mixed, size=1)
    fills = []
    real = forward.texts

    def counting(model, tokens, seqs, lengths):  # the real forward, its padded rectangle's fill noted
        fills.append(sum(lengths) / (tokens.shape[0] * tokens.shape[1]))
        return real(model, tokens, seqs, lengths)

    monkeypatch.setattr(forward, "texts", counting)
    release, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=shared_engine.run_on_engine_thread,
                              args=(lambda: (held.set(), release.wait(30)),))
    holder.start()
    assert held.wait(30)
    try:
        handles = [shared_engine.submit_embedding(t) for t in mixed]  # queued while the engine thread is held
    finally:
        release.set()
        holder.join()
    got = np.asarray([h.result().embedding for h in handles])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert fills and min(fills) >= EMBEDDING_FILL, fills
    assert len(fills) < len(mixed) / 4  # still batched: a few forwards, not one per text


def test_in_memory_vector_store_of_5000_chunks(embedder_dir, shared_engine, texts):
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore

    from parallm_integrations import ParaLLMEmbeddings

    emb = ParaLLMEmbeddings(model=embedder_dir, engine_kwargs=ENGINE, show_progress_bar=False)
    docs = [Document(page_content=t, metadata={"i": i}) for i, t in enumerate(texts[:5000])]
    store = InMemoryVectorStore.from_documents(docs, emb)
    assert len(store.store) == 5000
    for i in (0, 1234, 4999):
        [hit] = store.similarity_search_by_vector(emb.embed_documents([texts[i]])[0], k=1)
        assert hit.metadata["i"] == i and hit.page_content == texts[i]
    assert store.similarity_search("where is the capital?", k=3)  # queries: the model's query prompt


# -- LlamaIndex -----------------------------------------------------------------------------------
def test_llama_index_model_alias_and_large_batches(embedder_dir, shared_engine, texts, capsys):
    from pydantic import ValidationError

    from parallm_integrations import ParaLLMEmbeddings
    from parallm_integrations.llama_index import ParaLLMEmbedding

    emb = ParaLLMEmbedding(model=embedder_dir, engine_kwargs=ENGINE)  # model=, as ParaLLMLlamaIndex takes it
    assert emb.model_name == embedder_dir
    # the default chat model would refuse (NotAnEmbeddingModelError); the named one embeds
    np.testing.assert_allclose(emb.get_text_embedding(texts[0]), shared_engine.embed(texts[0])[0], atol=1e-6)
    assert ParaLLMEmbedding(model_name=embedder_dir, engine_kwargs=ENGINE).model_name == embedder_dir
    with pytest.raises(ValueError, match="differ"):
        ParaLLMEmbedding(model=embedder_dir, model_name="another/model")
    for cls in (ParaLLMEmbedding, ParaLLMEmbeddings):  # a misspelt argument is an error, not ignored
        with pytest.raises(ValidationError, match="modle"):
            cls(modle=embedder_dir)
    assert ParaLLMEmbeddings(model_name=embedder_dir).model == embedder_dir

    part = texts[:2500]
    want = small_batches(shared_engine, part)
    capsys.readouterr()
    np.testing.assert_allclose(emb.get_text_embedding_batch(part), want, rtol=0, atol=1e-6)
    assert "Generating embeddings" in capsys.readouterr().err  # LlamaIndex's bar, on from 1,000 texts
    # async: LlamaIndex gathers every 256-text batch at once (10 calls), together over the queue bound
    np.testing.assert_allclose(asyncio.run(emb.aget_text_embedding_batch(part)), want, rtol=0, atol=1e-6)
    assert "Generating embeddings" in capsys.readouterr().err
    emb.get_text_embedding_batch(part[:20])
    assert "Generating embeddings" not in capsys.readouterr().err


# -- the queue --------------------------------------------------------------------------------------
def test_a_full_queue_makes_a_large_batch_wait(embedder_dir, small_engine):
    from parallm_engine import Engine
    from parallm_engine.errors import QueueFullError

    from parallm_integrations import ParaLLMEmbeddings
    from parallm_integrations.llama_index import ParaLLMEmbedding
    from tests.model_zoo import prompt_ids

    batch = corpus(300, seed=2)
    want = small_batches(small_engine, batch)
    lc = ParaLLMEmbeddings(model=embedder_dir, engine_kwargs=SMALL_QUEUE)
    li = ParaLLMEmbedding(model=embedder_dir, engine_kwargs=SMALL_QUEUE)
    prompt = prompt_ids(12, small_engine.model_info.vocab_size, seed=1)
    release, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=small_engine.run_on_engine_thread,
                              args=(lambda: (held.set(), release.wait(60)),))
    holder.start()
    assert held.wait(30)  # the engine thread is busy: nothing leaves the queue until released
    try:
        chats = [small_engine.submit(prompt, max_tokens=6, temperature=0, ignore_eos=True)
                 for _ in range(small_engine.max_queue)]
        with pytest.raises(QueueFullError):  # the engine's own embed() (wait=False) says so at once
            small_engine.embed(batch[:2])
        waiters = [run_in_thread(lambda: lc.embed_documents(batch)),
                   run_in_thread(lambda: asyncio.run(li.aget_text_embedding_batch(batch)))]
        for thread, box in waiters:
            thread.join(0.5)
            assert thread.is_alive() and not box, box  # waiting for room, not failed
    finally:
        release.set()
        holder.join()
    assert all(len(Engine._collect(h).token_ids) == 6 for h in chats)
    for thread, box in waiters:
        thread.join(120)
        assert "error" not in box, box
        np.testing.assert_allclose(box["value"], want, rtol=0, atol=1e-6)


def test_a_large_batch_leaves_room_for_other_callers(embedder_dir, small_engine):
    """Two large batches at once (LangChain's, and LlamaIndex's async one: 12 concurrent calls) hold at
    most a quarter of the queue together; small chat and embedding requests keep being served meanwhile,
    none refused with QueueFullError."""
    from parallm_engine import Engine

    from parallm_integrations import ParaLLMEmbeddings
    from parallm_integrations.llama_index import ParaLLMEmbedding
    from tests.model_zoo import prompt_ids

    big = corpus(3000, seed=3)
    lc = ParaLLMEmbeddings(model=embedder_dir, engine_kwargs=SMALL_QUEUE, show_progress_bar=False)
    li = ParaLLMEmbedding(model=embedder_dir, engine_kwargs=SMALL_QUEUE, show_progress=False)
    prompts = [prompt_ids(10 + i, small_engine.model_info.vocab_size, seed=i) for i in range(2)]
    small_engine.reset_peaks()
    bulk = [run_in_thread(lambda: lc.embed_documents(big)),
            run_in_thread(lambda: asyncio.run(li.aget_text_embedding_batch(big)))]
    rounds = 0
    while any(t.is_alive() for t, _ in bulk) or rounds < 3:
        chats = [small_engine.submit(p, max_tokens=4, temperature=0, ignore_eos=True) for p in prompts]
        assert len(small_engine.embed(["a short question", "another one"])) == 2  # wait=False: raises if full
        assert all(len(Engine._collect(h).token_ids) == 4 for h in chats)
        rounds += 1
    assert rounds >= 3
    for thread, box in bulk:
        thread.join(120)
        assert "error" not in box, box
    np.testing.assert_allclose(bulk[0][1]["value"], bulk[1][1]["value"], rtol=0, atol=1e-6)
    share = small_engine.max_queue // 4
    assert small_engine.stats()["peak_in_flight"] <= share + 4  # the batches' share and this test's 4


# -- base_url -------------------------------------------------------------------------------------
def test_base_url_splits_a_large_call_into_requests_the_server_takes(shared_engine, texts, monkeypatch):
    import httpx
    from parallm_engine.serve import server_embeddings
    from parallm_engine.serve.server import ServerThread

    from parallm_integrations import ParaLLMEmbeddings
    from parallm_integrations.llama_index import ParaLLMEmbedding

    part = texts[:1100]
    want = small_batches(shared_engine, part)
    headers = {"Authorization": f"Bearer {KEY}"}
    with ServerThread(engine=shared_engine, api_key=KEY) as srv, \
            ServerThread(engine=shared_engine, api_key=KEY, max_request_share=0.05) as narrow:
        # one request of 1,100 texts: taken, a quarter of the queue in flight at a time, in input order
        r = httpx.post(srv.base_url + "/embeddings", json={"input": part}, timeout=300, headers=headers)
        assert r.status_code == 200, r.text
        got = [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        r = httpx.post(srv.base_url + "/embeddings", json={"input": ["x"] * 2049}, timeout=60, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_inputs"  # OpenAI's limit
        lc = ParaLLMEmbeddings(base_url=srv.base_url, api_key=KEY, max_retries=0, show_progress_bar=False)
        np.testing.assert_allclose(lc.embed_documents(part), want, rtol=0, atol=1e-6)
        np.testing.assert_allclose(asyncio.run(lc.aembed_documents(part)), want, rtol=0, atol=1e-6)
        # a server with a small request share (51 in flight) still takes requests of 256: they wait their turn
        li = ParaLLMEmbedding(base_url=narrow.base_url, api_key=KEY, max_retries=0)
        np.testing.assert_allclose(asyncio.run(li.aget_text_embedding_batch(part[:300])), want[:300],
                                   rtol=0, atol=1e-6)
        # a server that takes fewer inputs per request (40 here): the client halves its requests until they fit
        monkeypatch.setattr(server_embeddings, "MAX_INPUTS", 40)
        small = ParaLLMEmbeddings(base_url=narrow.base_url, api_key=KEY, max_retries=0, show_progress_bar=False)
        np.testing.assert_allclose(small.embed_documents(part[:300]), want[:300], rtol=0, atol=1e-6)
        assert small.client._remote_batch <= 40


def test_encoder_model_takes_a_batch_over_its_queue_bound(tmp_path):
    """A BERT-family model (``EncoderEngine``, mlx-embeddings) through the same classes: 1,000 texts on a
    64-text queue, in order, equal to small batches."""
    pytest.importorskip("mlx_embeddings")
    from parallm_engine import get_embedding_engine
    from parallm_engine.errors import QueueFullError

    from parallm_integrations import ParaLLMEmbeddings
    from tests.embedding_models import build_bert_encoder

    bert = str(build_bert_encoder(tmp_path / "bert-tiny"))
    settings = {"max_queue": 64}
    engine = get_embedding_engine(bert, **settings)
    part = corpus(1000, seed=4)
    with pytest.raises(QueueFullError):
        engine.embed(part, window=1000)  # all at once: over the bound
    emb = ParaLLMEmbeddings(model=bert, engine_kwargs=settings, show_progress_bar=False)
    np.testing.assert_allclose(emb.embed_documents(part), small_batches(engine, part), rtol=0, atol=1e-6)
    assert engine.stats()["in_flight"] == 0
    engine.shutdown()
