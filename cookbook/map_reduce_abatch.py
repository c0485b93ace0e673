"""Map-reduce with ``abatch``: summarise 32 short documents in parallel, then combine the summaries.

Every map call is a separate request on ParaLLM's shared engine; ``abatch`` puts all of them in flight
at once and the engine decodes them as one batch. The script runs the same chain again with
``max_concurrency=1`` (one request at a time) and prints the engine's peak concurrency and the speedup.

    .venv/bin/python cookbook/map_reduce_abatch.py             # 32 documents, default model
    .venv/bin/python cookbook/map_reduce_abatch.py --n 16 --max-tokens 24
"""

from __future__ import annotations

import argparse
import asyncio
import time

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from parallm_integrations import ChatParaLLM

TOPICS = [
    "the water cycle", "photosynthesis", "volcanoes", "the moon", "honey bees", "rainbows", "glaciers",
    "coral reefs", "the printing press", "electric cars", "tea", "the Eiffel Tower", "penguins",
    "thunderstorms", "the human heart", "deserts", "chess", "the Roman Empire", "solar panels",
    "octopuses", "the Great Wall of China", "bicycles", "earthquakes", "the Amazon river", "coffee",
    "the Internet", "owls", "tides", "bread", "the Sahara", "jazz", "comets",
]


def make_documents(n: int, run: str) -> list[dict]:
    docs = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        text = (
            f"Note {run}-{i}. This short note is about {topic}. People have studied {topic} for a long time, "
            f"and {topic} is often explained to students with simple examples and pictures."
        )
        docs.append({"doc": text})
    return docs


MAP = ChatPromptTemplate.from_messages(
    [("system", "You summarise notes in one short sentence."), ("human", "Summarise this note:\n{doc}")]
)
REDUCE = ChatPromptTemplate.from_messages(
    [("system", "You combine summaries into one sentence."), ("human", "Combine these summaries:\n{summaries}")]
)


async def run(chain, reduce_chain, docs: list[dict], max_concurrency: int | None, engine) -> tuple[float, int, str]:
    engine.reset_peaks()
    t0 = time.perf_counter()
    config = {"max_concurrency": max_concurrency} if max_concurrency else None
    summaries = await chain.abatch(docs, config=config)
    combined = await reduce_chain.ainvoke({"summaries": "\n".join(f"- {s.strip()}" for s in summaries[:8])})
    elapsed = time.perf_counter() - t0
    return elapsed, engine.stats()["peak_in_flight"], combined


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=32, help="number of documents (default 32)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per map summary (default 16)")
    parser.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct)")
    args = parser.parse_args()

    llm = ChatParaLLM(model=args.model, temperature=0, max_tokens=args.max_tokens)
    chain = MAP | llm | StrOutputParser()
    reduce_chain = REDUCE | llm.bind(max_tokens=32) | StrOutputParser()

    t0 = time.perf_counter()
    await llm.ainvoke("Hi", max_tokens=1)  # load the model (once per process)
    engine = llm._get_engine()
    print(f"model {engine.model_name} loaded in {time.perf_counter() - t0:.1f} s")

    # Different note ids per run, so neither run reads the other's documents from the prefix cache.
    t_par, peak_par, combined = await run(chain, reduce_chain, make_documents(args.n, "A"), None, engine)
    print(f"abatch, all in flight : {t_par:6.1f} s  peak concurrency {peak_par}")
    t_seq, peak_seq, _ = await run(chain, reduce_chain, make_documents(args.n, "B"), 1, engine)
    print(f"max_concurrency=1     : {t_seq:6.1f} s  peak concurrency {peak_seq}")
    print(f"speedup {t_seq / t_par:.2f}x over {args.n} documents")
    print(f"combined summary: {combined.strip()}")


if __name__ == "__main__":
    asyncio.run(main())
