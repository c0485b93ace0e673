"""LlamaIndex TreeSummarize over 12 short notes (``cookbook/data/``), concurrent vs one request at a time.

``TreeSummarize(use_async=True)`` summarises every chunk with its own ``apredict`` call and gathers
them; with ``ParaLLMLlamaIndex`` each call is a request on ParaLLM's shared engine, so all chunks are
decoded together in one continuous batch. The script then runs the same tree with ``use_async=False``
(LlamaIndex's one-at-a-time path) and prints the engine's peak concurrency and the speedup.

    .venv/bin/python cookbook/llamaindex_tree_summarize.py                  # default model, ~1-2 min on 2 cores
    .venv/bin/python cookbook/llamaindex_tree_summarize.py --max-tokens 32 --chunk-tokens 70
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from llama_index.core import SimpleDirectoryReader
from llama_index.core.indices.prompt_helper import PromptHelper
from llama_index.core.response_synthesizers import TreeSummarize

from parallm_integrations.llama_index import ParaLLMLlamaIndex

DATA = Path(__file__).resolve().parent / "data"
QUERY = "Summarize what these notes say about the town of Riverton."


def run(label: str, texts: list[str], use_async: bool, args) -> dict:
    # A different first line per run: the second run cannot reuse the first run's prompts from the
    # engine's prefix cache, so the comparison is fair.
    llm = ParaLLMLlamaIndex(temperature=0, max_tokens=args.max_tokens, system_prompt=f"Run: {label}.")
    engine = llm.engine
    # Chunks of at most --chunk-tokens tokens: the 12 notes become about 12 chunks (one request each);
    # the per-chunk summaries are then summarised again until one answer is left.
    helper = PromptHelper(context_window=llm.metadata.context_window, num_output=args.max_tokens,
                          chunk_size_limit=args.chunk_tokens, chunk_overlap_ratio=0.0)
    synth = TreeSummarize(llm=llm, use_async=use_async, prompt_helper=helper)
    before = engine.stats()
    engine.reset_peaks()
    t0 = time.perf_counter()
    answer = synth.get_response(QUERY, texts)
    wall = time.perf_counter() - t0
    after = engine.stats()
    return {
        "label": label,
        "wall": wall,
        "answer": str(answer).strip(),
        "peak": after["peak_in_flight"],
        "requests": after["requests_finished"] - before["requests_finished"],
        "generated": after["generated_tokens"] - before["generated_tokens"],
        "prefill": after["prefill_tokens"] - before["prefill_tokens"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=20, help="tokens per summary (default 20)")
    ap.add_argument("--chunk-tokens", type=int, default=70, help="chunk size limit in tokens (default 70)")
    ap.add_argument("--skip-serial", action="store_true", help="only the concurrent run")
    args = ap.parse_args()

    docs = SimpleDirectoryReader(str(DATA)).load_data()
    texts = [d.text for d in sorted(docs, key=lambda d: d.metadata.get("file_name", ""))]
    print(f"{len(texts)} documents from {DATA}")

    t0 = time.perf_counter()
    model = ParaLLMLlamaIndex().engine.model_name  # load the shared engine once, outside the timings
    print(f"engine: {model} (loaded in {time.perf_counter() - t0:.1f} s)\n")

    results = [run("concurrent", texts, True, args)]
    if not args.skip_serial:
        results.append(run("one at a time", texts, False, args))

    for r in results:
        print(f"[{r['label']}] {r['requests']} requests, peak in flight {r['peak']}, {r['wall']:.1f} s, "
              f"{r['generated']} tokens generated ({r['generated'] / r['wall']:.1f} tok/s), "
              f"{r['prefill']} prompt tokens prefilled")
    print(f"\nAnswer (concurrent run):\n{results[0]['answer']}\n")
    if len(results) == 2:
        print(f"speedup (one at a time / concurrent): {results[1]['wall'] / results[0]['wall']:.2f}x "
              f"with peak concurrency {results[0]['peak']}")


if __name__ == "__main__":
    main()
