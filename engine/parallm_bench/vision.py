"""`parallm bench --workloads vision`: 8 requests on one image, the image prefix cache at work.

The model is a random-weight SmolVLM (Idefics3 layout, ``vision_tiny.build_vlm``) at SmolVLM-256M's
shapes: a 12-layer, 768-wide SigLIP tower over one 512x512 image (1,024 patches of 16 pixels, 64 image
tokens after the pixel shuffle) and SmolLM2-135M's language model, so the vision encoder costs what a
real one does (``--quick``: the tiny test size, where it costs nothing). Built once into
``~/.cache/parallm/shapes/vision-<size>`` (``PARALLM_SHAPES_DIR`` moves it).

Measured on a fresh engine, after a warm-up request on another image:

- ``cold``: one request on a new chart (vision encoder + prefill of the whole prompt): its TTFT.
- ``later``: 7 concurrent requests on the same chart with new questions: TTFT of each (the image's
  features come from the feature cache, the prompt up to and including the image from the radix tree),
  and how many times the encoder ran for them (0).
- ``together``: 8 requests on a third chart submitted at once: the encoder runs once for all 8.
- ``same_tokens``: the first question asked again (a full cache hit) gives the cold run's greedy tokens.

TTFT is measured from submission (the chat's image decoding and processing happen before, on the
caller's thread, and are reported apart as ``prepare_ms_p50``).
"""

from __future__ import annotations

import io
import os
import statistics
import time
from pathlib import Path

FULL_VISION = {"size": "smolvlm-256m", "later": 7, "new_tokens": 4}
QUICK_VISION = {"size": "tiny", "later": 7, "new_tokens": 4}
QUESTIONS = ["What is the title of this chart?", "Which bar is the tallest?", "Which bar is the shortest?",
             "How many bars are there?", "What is the overall trend?", "What colour are the bars?",
             "Estimate the largest value.", "Summarise the chart in one sentence."]


def chart_png(seed: int, side: int = 512) -> bytes:
    """A synthetic bar chart (PIL): different seeds, different pixels."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (side, side * 3 // 4), "white")
    d = ImageDraw.Draw(img)
    d.text((8, 4), f"Chart {seed}: sales by quarter", fill="black")
    bottom, width, gap = img.height - 2, side // 6, side // 24
    for q in range(4):
        h = 2 + ((seed * 37 + q * 53) % (img.height * 3 // 4))
        d.rectangle([gap + q * (width + gap), bottom - h, gap + q * (width + gap) + width, bottom],
                    fill=((seed * 70) % 256, 90 + q * 40, (200 - seed * 30) % 256))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _messages(png: bytes, question: str) -> list[dict]:
    import base64

    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def model_dir(size: str) -> Path:
    """Where the built VLM is kept: next to ``bench_shapes``' models."""
    root = Path(os.environ.get("PARALLM_SHAPES_DIR") or Path.home() / ".cache" / "parallm" / "shapes")
    return root / f"vision-{size}"


def prepare(size: str, out_dir=None) -> Path:
    """The random VLM's directory, built unless already there (a finished build writes ``.done``)."""
    from parallm_bench.vision_tiny import build_vlm

    path = Path(out_dir) if out_dir is not None else model_dir(size)
    if not (path / ".done").exists():
        build_vlm("idefics3", path, size)
        (path / ".done").write_text("ok\n")
    return path


def _submit_all(engine, message_lists: list[list[dict]], new_tokens: int) -> tuple[list, list[float], list]:
    """Prompts built first (timed apart), then submitted together; returns (finished handles, prepare
    seconds, generated token ids), one each per request."""
    from parallm_engine.vision.chat import chat_prompt

    prompts, prep = [], []
    for m in message_lists:
        t0 = time.perf_counter()
        prompts.append(chat_prompt(engine, m, None, {}))
        prep.append(time.perf_counter() - t0)
    handles = [engine.submit(p, max_tokens=new_tokens, temperature=0.0) for p in prompts]
    tokens = [[t for delta in h for t in delta.token_ids] for h in handles]
    return handles, prep, tokens


def _stream_during_encode(engine, messages: list[dict], new_tokens: int) -> dict:
    """A text stream decodes; a request on a new image arrives (its vision encoder runs on the worker
    thread): the stream's inter-token gaps before and during the encoder's run (the ``arrival``
    workload's ITL, here against an image encode)."""
    import contextlib
    import threading

    from parallm_engine.errors import RequestCancelledError
    from parallm_engine.vision.chat import chat_prompt

    enc = engine.model.vision
    stamps: list[float] = []
    room = max(64, min(4000, engine.context_window - 64))
    text = engine.submit(engine.encode("Write a long story about a chart."), max_tokens=room, temperature=0.0,
                         ignore_eos=True)

    def consume():
        with contextlib.suppress(RequestCancelledError):  # the stream is aborted once the image is done
            for _ in text:
                stamps.append(time.monotonic())

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    try:
        while len(stamps) < 8 and reader.is_alive():
            time.sleep(0.005)
        runs = enc.encoder_runs
        image = engine.submit(chat_prompt(engine, messages, None, {}), max_tokens=new_tokens, temperature=0.0)
        for _ in image:
            pass
    finally:
        text.abort()
        reader.join(30)
    start, end = enc.last_encode if enc.encoder_runs > runs else (0.0, 0.0)
    before = [b - a for a, b in zip(stamps, stamps[1:]) if b <= start]
    # every gap that overlaps the encoder's run, and the tokens delivered while it ran
    overlap = [b - a for a, b in zip(stamps, stamps[1:]) if b > start and a < end]
    return {
        "encode_s": round(end - start, 4),
        "stream_tokens_during_encode": sum(1 for t in stamps if start <= t <= end),
        "stream_itl_p50_before_ms": round(statistics.median(before) * 1e3, 1) if before else None,
        "stream_itl_p50_during_encode_ms": round(statistics.median(overlap) * 1e3, 1) if overlap else None,
        "stream_max_gap_during_encode_ms": round(max(overlap) * 1e3, 1) if overlap else None,
    }


def run_vision(sizes: dict | None = None, tick=lambda msg: None, out_dir=None) -> dict:
    from parallm_engine.core.engine import Engine

    sizes = sizes or FULL_VISION
    n_later, new = sizes["later"], sizes["new_tokens"]
    tick(f"vision: building / loading the {sizes['size']} VLM")
    engine = Engine(str(prepare(sizes["size"], out_dir)))
    try:
        enc = engine.model.vision
        side = 512 if sizes["size"] != "tiny" else 48
        _submit_all(engine, [_messages(chart_png(100, side), "Describe it.")], new)  # warm-up, another image
        runs0 = enc.encoder_runs
        tick("vision: cold request (encoder + prefill)")
        chart = chart_png(1, side)
        (cold,), prep_cold, (cold_tokens,) = _submit_all(engine, [_messages(chart, QUESTIONS[0])], new)
        runs1 = enc.encoder_runs
        tick(f"vision: {n_later} concurrent later requests on the same image")
        later, prep_later, _ = _submit_all(engine, [_messages(chart, q) for q in QUESTIONS[1: 1 + n_later]], new)
        runs2 = enc.encoder_runs
        _, _, (again_tokens,) = _submit_all(engine, [_messages(chart, QUESTIONS[0])], new)
        together, _, _ = _submit_all(engine, [_messages(chart_png(2, side), q) for q in QUESTIONS[: 1 + n_later]], new)
        runs3 = enc.encoder_runs
        during = _stream_during_encode(engine, _messages(chart_png(3, side), QUESTIONS[0]), new)
        cold_ttft = cold.request.ttft()
        later_ttft = [h.request.ttft() for h in later]
        p50 = statistics.median(later_ttft)
        vp = cold.request.vision
        return {
            "model": sizes["size"],
            "prompt_tokens": len(vp.token_ids),
            "image_tokens": int((vp.row_index >= 0).sum()),
            "cold_ttft_s": round(cold_ttft, 4),
            "cold_encoder_runs": runs1 - runs0,
            "later_requests": n_later,
            "later_ttft_p50_s": round(p50, 4),
            "later_ttft_max_s": round(max(later_ttft), 4),
            "later_encoder_runs": runs2 - runs1,
            "ttft_speedup_p50": round(cold_ttft / p50, 1) if p50 else None,
            "together_requests": len(together),
            "together_encoder_runs": runs3 - runs2,
            "together_ttft_p50_s": round(statistics.median(h.request.ttft() for h in together), 4),
            "same_tokens": again_tokens == cold_tokens,
            "prepare_ms_p50": round(statistics.median(prep_cold + prep_later) * 1e3, 1),
            "feature_hits": enc.feature_hits,
            **during,
        }
    finally:
        engine.shutdown()


def format_lines(entry: dict) -> list[str]:
    return [
        f"vision ({entry['model']} random VLM, {entry['image_tokens']} image tokens in a "
        f"{entry['prompt_tokens']}-token prompt): 8 requests on one image",
        f"  cold TTFT {entry['cold_ttft_s'] * 1e3:8.1f} ms (encoder runs {entry['cold_encoder_runs']}); "
        f"{entry['later_requests']} concurrent later requests: TTFT p50 {entry['later_ttft_p50_s'] * 1e3:.1f} ms, "
        f"max {entry['later_ttft_max_s'] * 1e3:.1f} ms (encoder runs {entry['later_encoder_runs']}): "
        f"x{entry['ttft_speedup_p50']} lower",
        f"  {entry['together_requests']} submitted together on a new image: encoder runs "
        f"{entry['together_encoder_runs']}, TTFT p50 {entry['together_ttft_p50_s'] * 1e3:.1f} ms; cache hit == cold "
        f"tokens: {entry['same_tokens']}; image decode+processing p50 {entry['prepare_ms_p50']} ms (caller thread)",
        f"  a running stream while a new image is encoded ({entry['encode_s'] * 1e3:.1f} ms, off the engine thread): "
        f"{entry['stream_tokens_during_encode']} tokens delivered meanwhile, ITL p50 "
        f"{entry['stream_itl_p50_during_encode_ms']} ms (before: {entry['stream_itl_p50_before_ms']} ms), "
        f"max gap {entry['stream_max_gap_during_encode_ms']} ms",
    ]
