"""Cookbook: ask 8 questions about each of 4 charts in parallel (LangChain), with image prefix caching.

    python examples/vision_charts.py [VLM_DIR or a Hugging Face model id, org/name]

VLM_DIR: a local LLaVA / SmolVLM (Idefics3) / Pixtral / Mistral 3 / Gemma 3 / Qwen2.5-VL / Qwen3-VL checkpoint in MLX
format.
Without one (the example downloads nothing unasked), a tiny random-weight LLaVA is built (parallm_bench.vision_tiny):
its answers are noise, and it says so; the cache hit rate, the encoder-run counts and the timings are real.

Prints: the chain's answers, the prefix-cache hit rate, the speedup of the cached run over a cold one
(the same chain on an engine with the prefix cache and the image-feature cache off), and a bench line:
8 requests on one image, the vision encoder's runs and the TTFT of the later requests vs a cold request.
On the tiny model the vision tower costs nothing, so the cache saves little there; ``parallm bench
--workloads vision`` measures the same at SmolVLM-256M's shapes, where the encoder dominates a cold
request.
"""

from __future__ import annotations

import base64
import io
import statistics
import sys
import tempfile
import time

from PIL import Image, ImageDraw

QUESTIONS = ["What is the title?", "Which bar is tallest?", "Which bar is shortest?", "How many bars?",
             "What is the trend?", "What colour are the bars?", "Estimate the largest value.", "Summarise it."]


def make_chart(i: int) -> bytes:
    img = Image.new("RGB", (224, 168), "white")
    d = ImageDraw.Draw(img)
    d.text((8, 4), f"Chart {i}: sales by quarter", fill="black")
    for q in range(4):
        h = 20 + ((i * 37 + q * 53) % 110)
        d.rectangle([20 + q * 50, 160 - h, 55 + q * 50, 160], fill=((i * 70) % 256, 90 + q * 40, 200 - i * 30))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def main() -> None:
    from langchain_core.messages import HumanMessage
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.runnables import RunnableLambda

    from parallm_engine import get_engine
    from parallm_integrations import ChatParaLLM

    if len(sys.argv) > 1:
        path, real = sys.argv[1], True
    else:
        from parallm_bench.vision_tiny import build_tiny_vlm

        path, real = str(build_tiny_vlm("llava", tempfile.mkdtemp(prefix="tiny-vlm-"))), False
        print("NOTE: no VLM given; using a tiny RANDOM-weight LLaVA built locally: answers are noise, "
              "cache and timing numbers are real.\n")
    charts = [base64.b64encode(make_chart(i)).decode() for i in range(4)]
    jobs = [{"chart": c, "question": q} for c in charts for q in QUESTIONS]

    def to_messages(job):
        return [HumanMessage(content=[{"type": "image", "base64": job["chart"], "mime_type": "image/png"},
                                      {"type": "text", "text": job["question"]}])]

    llm = ChatParaLLM(model=path, temperature=0.0, max_tokens=16)
    chain = RunnableLambda(to_messages) | llm | StrOutputParser()
    eng = get_engine(path)
    eng.chat([{"role": "user", "content": "warm-up"}], max_tokens=2)  # timings below exclude first-call setup
    before = eng.stats()
    t0 = time.perf_counter()
    answers = chain.batch(jobs, config={"max_concurrency": len(jobs)})
    cached_s = time.perf_counter() - t0
    after = eng.stats()
    for job, ans in list(zip(jobs, answers))[:: len(QUESTIONS) // 2]:
        print(f"  chart {charts.index(job['chart'])} | {job['question']:<28} -> {ans[:60]!r}")
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after.get("cached_tokens", 0) - before.get("cached_tokens", 0)
    vision = after["vision"]
    print(f"\n{len(jobs)} requests: prefix-cache hit rate {cached / max(1, prompt_tokens):.0%} "
          f"({cached}/{prompt_tokens} prompt tokens), vision encoder runs {vision['encoder_runs']} for 4 images")

    # Cold: the same 32 requests through the same chain, on an engine with the prefix cache and the
    # image-feature cache off (so the comparison is of the caches, not of two different call paths).
    cold_llm = ChatParaLLM(model=path, temperature=0.0, max_tokens=16, engine_kwargs={"enable_prefix_cache": False})
    cold_eng = get_engine(path, enable_prefix_cache=False)
    cold_eng.model.vision.budget_bytes = 0
    cold_eng.chat([{"role": "user", "content": "warm-up"}], max_tokens=2)
    cold_chain = RunnableLambda(to_messages) | cold_llm | StrOutputParser()
    t0 = time.perf_counter()
    cold_chain.batch(jobs, config={"max_concurrency": len(jobs)})
    cold_s = time.perf_counter() - t0
    print(f"cached run {cached_s:.2f} s vs cold run {cold_s:.2f} s: speedup x{cold_s / cached_s:.2f} "
          f"(cold encoder runs: {cold_eng.model.vision.encoder_runs})")

    # Bench: 8 requests on one new image: the first (cold: encoder + prefill), then 7 concurrent ones
    # with new questions that find its features and its prefix cached.
    from parallm_bench.vision import _messages, _submit_all

    chart = make_chart(9)
    runs = eng.model.vision.encoder_runs
    (first,), _, _ = _submit_all(eng, [_messages(chart, QUESTIONS[0])], 1)
    later, _, _ = _submit_all(eng, [_messages(chart, q) for q in QUESTIONS[1:]], 1)
    later_ttft = statistics.median(h.request.ttft() for h in later)
    print(f"bench: 8 requests on one image: encoder runs {eng.model.vision.encoder_runs - runs}, "
          f"TTFT first (cold) {first.request.ttft() * 1e3:.1f} ms, 7 concurrent later (median) "
          f"{later_ttft * 1e3:.1f} ms: cold / later = x{first.request.ttft() / later_ttft:.1f}"
          + ("" if real else " (tiny random model: its vision tower is ~free, so the 7 batched later "
                             "requests cost as much as the cold one)"))


if __name__ == "__main__":
    main()
