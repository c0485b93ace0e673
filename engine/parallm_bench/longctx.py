"""The ``longctx`` workload of `parallm bench`: many questions over one long shared document.

``requests`` (16) chat prompts share one document of ``doc_tokens`` (8,000) tokens and differ in their
question. The first request runs alone, on an empty prefix cache: its TTFT is a cold prefill of the
whole prompt (the reference). Once it has finished, the other ``requests - 1`` arrive together: with the
radix cache they compute only their question. Greedy, ``new_tokens`` (32) each, EOS ignored.

Reported (``parallm``): ``ttft_cold_s``; ``ttft_p50_s`` / ``ttft_p99_s`` of the requests after the first;
``tok_s`` (all generated tokens / wall of both phases); ``wall_s``; ``prefill_tokens`` (computed) and
``prompt_tokens``; ``peak_kv_bytes`` (``engine.stats()``: the running batch's KV at its peak),
``memory`` (the engine's KV gauges after the run: running rows, prefix cache, bytes per token) and
``kv_bytes_max_sampled`` (running + prefix cache, sampled every 20 ms); ``kv_bytes_private`` (what the
requests' KV would take with one private copy of the document each); ``peak_mem_mb`` (MLX's peak
allocation during the workload) and ``process_peak_rss_mb`` (``getrusage``: the whole bench process's
peak so far, every earlier workload included). Ratios: ``ttft_cold_vs_warm_p50`` (cold TTFT / p50 of
the others) and ``kv_private_vs_peak`` (``kv_bytes_private`` / the largest KV held).

The document plus the longest question and the reply must fit the model's context window (8,192 tokens
for the default model); a longer ``doc_tokens`` is cut to fit and ``doc_tokens`` says what was used.
"""

from __future__ import annotations

import asyncio
import random
import resource
import time
from dataclasses import dataclass

import mlx.core as mx

from parallm_bench.bench import _pct


@dataclass
class LongctxSizes:
    requests: int = 16
    doc_tokens: int = 8000
    new_tokens: int = 32
    seed: int = 77


FULL_LONGCTX = LongctxSizes()
QUICK_LONGCTX = LongctxSizes(requests=6, doc_tokens=1500, new_tokens=8)

QUESTIONS = (
    "Who is the main subject of the document?", "Summarise the second section in one sentence.",
    "Which numbers appear most often?", "What happens at the end?", "List three places that are mentioned.",
    "Is there a contradiction anywhere? Quote it.", "What is the tone of the text?",
    "Give the document a title.", "Which word is repeated most?", "What would you ask the author?",
    "Explain the first paragraph to a child.", "What is missing from the document?",
    "Translate the last sentence into French.", "Which section is the longest?",
    "Name two people or roles in the text.", "What is the single most important fact?",
)

_WORDS = ("the river engine report market winter signal harbor council budget station archive village "
          "network theory garden forest mountain letter record season museum bridge factory customer "
          "planet ocean valley meeting contract library hospital school railway painting").split()


def build_document(encode, n_tokens: int, seed: int) -> list[int]:
    """Exactly ``n_tokens`` ids of seeded, sentence-shaped text in numbered sections."""
    rng = random.Random(seed)
    ids: list[int] = []
    section = 0
    while len(ids) < n_tokens:
        section += 1
        sentences = [" ".join(rng.choices(_WORDS, k=rng.randint(6, 14))).capitalize() +
                     f" in {rng.randint(1800, 2030)}." for _ in range(rng.randint(4, 9))]
        ids += encode(f"\n\nSection {section}.\n" + " ".join(sentences))
    return ids[:n_tokens]


def build_prompts(engine, sz: LongctxSizes) -> tuple[list[list[int]], int]:
    """The requests' token ids (document first, question last) and the document length actually used."""
    def encode(s):
        return engine.encode(s, add_special_tokens=False)

    head = encode("<|im_start|>user\nRead this document and answer the question after it.\n")
    questions = [encode(f"\n\nQuestion {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}<|im_end|>\n<|im_start|>assistant\n")
                 for i in range(sz.requests)]
    room = engine.context_window - len(head) - max(map(len, questions)) - sz.new_tokens - 1
    doc_tokens = max(1, min(sz.doc_tokens, room))
    doc = build_document(encode, doc_tokens, sz.seed)
    return [head + doc + q for q in questions], doc_tokens


def run_longctx(engine, sz: LongctxSizes) -> dict:
    prompts, doc_tokens = build_prompts(engine, sz)
    engine.clear_prefix_cache()
    engine.reset_peaks()
    mx.reset_peak_memory()
    before = engine.stats()
    kv_max = [0]

    async def one(prompt, loop, t_ref):
        handle = engine.submit(prompt, loop=loop, max_tokens=sz.new_tokens, temperature=0.0, ignore_eos=True)
        times, n = [], 0
        async for d in handle:
            if d.token_ids:
                times.append(time.perf_counter())
                n += len(d.token_ids)
        return (times[0] - t_ref if times else None), n

    async def sample_kv(stop: asyncio.Event):
        while not stop.is_set():
            mem = engine.stats().get("memory") or {}
            kv_max[0] = max(kv_max[0], mem.get("kv_bytes_running", 0) + mem.get("kv_bytes_prefix_cache", 0))
            try:
                await asyncio.wait_for(stop.wait(), 0.02)
            except asyncio.TimeoutError:
                pass

    async def main():
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_kv(stop))
        t0 = time.perf_counter()
        cold = await one(prompts[0], loop, t0)
        t1 = time.perf_counter()
        warm = await asyncio.gather(*(one(p, loop, t1) for p in prompts[1:]))
        end = time.perf_counter()
        stop.set()
        await sampler
        return cold, warm, t0, t1, end

    cold, warm, t0, t1, end = asyncio.run(main())
    after = engine.stats()
    ttfts = [w[0] for w in warm if w[0] is not None]
    tokens = cold[1] + sum(w[1] for w in warm)
    mem = after.get("memory") or {}
    per_token = mem.get("kv_bytes_per_token") or engine.model_info.kv_bytes_per_token()
    private = sum(len(p) + sz.new_tokens for p in prompts) * per_token
    held = max(after["peak_kv_bytes"], kv_max[0])
    out = {
        "requests": len(prompts), "doc_tokens": doc_tokens, "prompt_tokens": sum(map(len, prompts)),
        "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
        "tokens": tokens, "wall_s": round(end - t0, 3), "tok_s": round(tokens / (end - t0), 2),
        "cold_wall_s": round(t1 - t0, 3), "warm_wall_s": round(end - t1, 3),
        "ttft_cold_s": round(cold[0], 4) if cold[0] is not None else None,
        "ttft_p50_s": round(_pct(ttfts, 0.5), 4), "ttft_p99_s": round(_pct(ttfts, 0.99), 4),
        "peak_kv_bytes": after["peak_kv_bytes"], "kv_bytes_max_sampled": kv_max[0], "memory": mem,
        "kv_bytes_private": private,
        "peak_mem_mb": round(mx.get_peak_memory() / 2**20, 1),
        "process_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    entry = {"parallm": out, "ratios": {
        "ttft_cold_vs_warm_p50": round(out["ttft_cold_s"] / out["ttft_p50_s"], 2) if out["ttft_p50_s"] else None,
        "kv_private_vs_peak": round(private / held, 2) if held else None,
    }}
    return entry


def format_lines(entry: dict) -> list[str]:
    p = entry["parallm"]
    mb = 2**20
    prefix_mb = (p.get("memory") or {}).get("kv_bytes_prefix_cache", 0) / mb
    return [
        f"longctx: {p['requests']} questions over one {p['doc_tokens']}-token document: "
        f"cold TTFT {p['ttft_cold_s']:.2f} s, then TTFT p50 {p['ttft_p50_s']:.3f} p99 {p['ttft_p99_s']:.3f} s; "
        f"{p['tok_s']:.1f} tok/s over {p['wall_s']:.1f} s; prefill {p['prefill_tokens']} of {p['prompt_tokens']} "
        "prompt tokens",
        f"  KV: peak running {p['peak_kv_bytes'] / mb:.0f} MB, running + prefix cache at most "
        f"{p['kv_bytes_max_sampled'] / mb:.0f} MB (after: prefix cache {prefix_mb:.0f} MB); "
        f"private copies would be {p['kv_bytes_private'] / 2**20:.0f} MB; MLX peak {p['peak_mem_mb']:.0f} MB, "
        f"process peak RSS {p['process_peak_rss_mb']:.0f} MB",
    ]
