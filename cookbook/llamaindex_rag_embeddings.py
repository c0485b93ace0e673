"""A LlamaIndex RAG pipeline where the embeddings AND the answers come from ParaLLM engines in one process.

``VectorStoreIndex`` embeds the 12 notes in ``cookbook/data/`` with ``ParaLLMEmbedding`` (every node of the
index in flight at once: one batched prefill on the engine), then a query engine answers several questions
concurrently (``aquery``): each question's embedding and each answer is a request on the shared engines.
The engines' ``stats()`` before/after show the fan-out: requests, peak in flight, prefill forwards
(texts per forward), embeddings delivered.

    .venv/bin/python cookbook/llamaindex_rag_embeddings.py \\
        --embed-model Qwen/Qwen3-Embedding-0.6B      # a real embedding model (HF id in the local cache, or a path)
    .venv/bin/python cookbook/llamaindex_rag_embeddings.py   # offline: no embedding model at hand

Without ``--embed-model`` the embeddings come from the default chat model itself (SmolLM2-135M's mean-pooled
hidden states, ``pooling="mean"``): not a trained embedder, so retrieval is rough, but it runs anywhere and
then ONE engine serves both the index and the answers, in the same batches.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from llama_index.core import Settings, SimpleDirectoryReader, VectorStoreIndex

from parallm_integrations.llama_index import ParaLLMEmbedding, ParaLLMLlamaIndex

DATA = Path(__file__).resolve().parent / "data"
QUESTIONS = [
    "When was Riverton founded?",
    "What happens at the Riverton festival?",
    "Which railway line reaches the town?",
    "What is the climate like in Riverton?",
]
COUNTERS = ("requests_finished", "embeddings_finished", "prefill_forwards", "prefill_tokens", "generated_tokens")


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in COUNTERS}


def show(label: str, engines: dict, before: dict, wall: float) -> None:
    for name, eng in engines.items():
        d = delta(before[name], eng.stats())
        print(f"[{label}] {name} engine ({eng.model_name}): {d['requests_finished']} requests "
              f"({d['embeddings_finished']} embeddings), peak in flight {eng.stats()['peak_in_flight']}, "
              f"{d['prefill_forwards']} prefill forwards for {d['prefill_tokens']} prompt tokens, "
              f"{d['generated_tokens']} tokens generated, {wall:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--embed-model", default=None, help="an embedding model (default: the chat model, mean-pooled)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default 48)")
    args = ap.parse_args()

    llm = ParaLLMLlamaIndex(temperature=0, max_tokens=args.max_tokens)
    embed = ParaLLMEmbedding(model_name=args.embed_model, pooling=None if args.embed_model else "mean")
    Settings.llm, Settings.embed_model = llm, embed
    Settings.chunk_size = 128  # a few nodes per note: more texts to embed at once

    t0 = time.perf_counter()
    engines = {"chat": llm.engine, "embedding": embed._client.engine()}
    shared = engines["chat"] is engines["embedding"]
    print(f"engines loaded in {time.perf_counter() - t0:.1f} s; "
          + ("ONE engine serves embeddings and answers" if shared else "two engines in this process"))
    if shared:
        engines = {"shared": engines["chat"]}

    docs = SimpleDirectoryReader(str(DATA)).load_data()
    before = {n: e.stats() for n, e in engines.items()}
    for e in engines.values():
        e.reset_peaks()
    t0 = time.perf_counter()
    index = VectorStoreIndex.from_documents(docs)  # every node's text embedded in one batch call
    show("index", engines, before, time.perf_counter() - t0)

    query_engine = index.as_query_engine(similarity_top_k=2)
    before = {n: e.stats() for n, e in engines.items()}
    for e in engines.values():
        e.reset_peaks()

    async def ask_all():
        return await asyncio.gather(*(query_engine.aquery(q) for q in QUESTIONS))

    t0 = time.perf_counter()
    answers = asyncio.run(ask_all())  # all questions at once: embeddings, then answers, batched
    show("queries", engines, before, time.perf_counter() - t0)
    for q, a in zip(QUESTIONS, answers):
        sources = ", ".join(n.node.metadata.get("file_name", "?") for n in a.source_nodes)
        print(f"\nQ: {q}\n   sources: {sources}\nA: {str(a).strip()}")


if __name__ == "__main__":
    main()
