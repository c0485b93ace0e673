"""Images in the conversation: tiny random-weight VLMs of the mlx-vlm families (LLaVA, Idefics3/SmolVLM,
Mistral 3 (Pixtral tower), Gemma 3 (sliding-window layers: the engine's "mixed" cache layout),
Qwen2-VL / Qwen2.5-VL / Qwen3-VL (+ MoE) (M-RoPE: per-sequence 3-D positions; Qwen3-VL's DeepStack
features)) built here, images drawn with PIL. The engine's greedy tokens must equal mlx-vlm's own
generation (``generate_step`` on the processor's inputs), batched or alone, cold or from the image
caches; the vision encoder runs off the engine thread and the async entry points prepare images off the
event loop; a checkpoint the engine cannot batch exactly is refused images with a typed error."""

from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from PIL import Image, ImageDraw

from parallm_engine import Engine  # noqa: F401
from parallm_engine.errors import ImageInputError, InvalidRequestError
from parallm_engine.vision.inputs import decode_image
from parallm_bench.vision_tiny import build_tiny_vlm

FAMILIES = ["llava", "idefics3", "mistral3", "gemma3", "qwen2_5_vl", "qwen3_vl"]
MROPE_FAMILIES = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe"]
N_TOKENS = 10
_BUILT: dict = {}  # family -> its tiny checkpoint (one per test session: the engines are shared)


def chart(seed: int, size=(48, 40)) -> Image.Image:
    """A small synthetic 'bar chart': different seeds give different pixels."""
    img = Image.new("RGB", size, (255, 255, 255))
    d = ImageDraw.Draw(img)
    for i in range(4):
        h = 5 + (seed * 7 + i * 11) % 30
        d.rectangle([4 + i * 11, size[1] - h, 12 + i * 11, size[1] - 1],
                    fill=((seed * 60 + i * 40) % 256, (seed * 90) % 256, (i * 70) % 256))
    return img


def png_bytes(img: Image.Image) -> bytes:
    b = io.BytesIO()
    img.save(b, "PNG")
    return b.getvalue()


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def ask(question: str, *images) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(im) if isinstance(im, Image.Image)
                                                                  else im)}} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def tiny_vlm_path(family: str, tmp_path_factory):
    if family not in _BUILT:
        _BUILT[family] = build_tiny_vlm(family, tmp_path_factory.mktemp(family))
    return _BUILT[family]


@pytest.fixture(scope="module", params=FAMILIES)
def vlm_engine(request, tmp_path_factory):
    from parallm_engine import get_engine

    # the shared engine: ChatParaLLM(model=path) finds the same one
    return get_engine(str(tiny_vlm_path(request.param, tmp_path_factory)))


@pytest.fixture(scope="module", params=MROPE_FAMILIES)
def mrope_engine(request, tmp_path_factory):
    from parallm_engine import get_engine

    return get_engine(str(tiny_vlm_path(request.param, tmp_path_factory)))


def reference(eng: Engine, messages: list[dict], n: int = N_TOKENS) -> list[int]:
    """mlx-vlm's own greedy generation on the processor's inputs for the same rendered chat."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    from parallm_engine.vision.inputs import extract_images

    enc = eng.model.vision
    stripped, images = extract_images(messages)
    text = enc._render(stripped, None, len(images), {})
    if images:
        inputs = enc.processor(text=[text], images=[im.image for im in images])
    else:
        inputs = {"input_ids": mx.array([enc.tokenizer.encode(text, add_special_tokens=False)])}
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "pixel_values")}
    mask = inputs.get("attention_mask") if images else None  # gemma3's merge reads it
    out = []
    for tok, _ in generate_step(inputs["input_ids"], enc.vlm, inputs.get("pixel_values"), mask,
                                max_tokens=n, temperature=0.0, **extra):
        out.append(int(tok))
        if len(out) == n:
            break
    return out


def greedy(eng: Engine, messages, n: int = N_TOKENS) -> list[int]:
    return eng.chat(messages, max_tokens=n, temperature=0.0, ignore_eos=True).token_ids


def test_matches_mlx_vlm_generation(vlm_engine):
    for seed, q in ((1, "What is the tallest bar?"), (2, "Describe the chart.")):
        msgs = ask(q, chart(seed))
        assert greedy(vlm_engine, msgs) == reference(vlm_engine, msgs)
    two = ask("Compare the two charts.", chart(3), chart(4))  # two images in one message
    assert greedy(vlm_engine, two) == reference(vlm_engine, two)


def test_text_only_request_to_a_vlm(vlm_engine):
    msgs = [{"role": "user", "content": "Say something about charts."}]
    assert greedy(vlm_engine, msgs) == reference(vlm_engine, msgs)


def test_different_images_change_the_answer(vlm_engine):
    a = greedy(vlm_engine, ask("What is shown?", chart(11)))
    b = greedy(vlm_engine, ask("What is shown?", chart(12)))
    assert a != b  # the image reaches the model (not only its placeholder tokens)


def test_16_concurrent_over_4_images_equal_alone(vlm_engine):
    """mlx-vlm#1668 (corrupted outputs at 2+ concurrent requests): 16 requests over 4 images, batched,
    each equals that request run alone through mlx-vlm."""
    images = [chart(20 + i) for i in range(4)]
    questions = ["What is the max?", "What is the min?", "How many bars?", "Which colour?"]
    convs = [ask(q, im) for im in images for q in questions]
    from parallm_engine.vision.chat import chat_prompt

    prompts = [chat_prompt(vlm_engine, m, None, {}) for m in convs]
    results = vlm_engine.generate(prompts, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    for conv, res in zip(convs, results):
        assert res.token_ids == reference(vlm_engine, conv)


def test_image_cache_hit_equals_cold(vlm_engine):
    enc = vlm_engine.model.vision
    msgs = ask("Summarise this chart in one word.", chart(40))
    runs = enc.encoder_runs
    cold = greedy(vlm_engine, msgs)
    assert enc.encoder_runs == runs + 1
    before = vlm_engine.stats()
    warm = vlm_engine.chat(msgs, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    assert warm.token_ids == cold
    assert enc.encoder_runs == runs + 1  # neither the encoder ...
    assert warm.usage.cached_tokens > 0
    assert vlm_engine.stats()["prefill_tokens"] - before["prefill_tokens"] < 4  # ... nor the prefill ran again
    # A new question about the same image: the image's prefix is reused, the features too.
    other = ask("Which bar is highest?", chart(40))
    assert greedy(vlm_engine, other) == reference(vlm_engine, other)
    assert enc.encoder_runs == runs + 1


def test_same_pixels_any_encoding_share_the_key(vlm_engine):
    enc = vlm_engine.model.vision
    jpeg = io.BytesIO()
    chart(50, size=(64, 48)).save(jpeg, "JPEG", quality=70)
    jpeg_bytes = jpeg.getvalue()
    decoded = Image.open(io.BytesIO(jpeg_bytes)).convert("RGB")
    png = png_bytes(decoded)  # the JPEG's pixels, re-encoded losslessly
    assert decode_image(jpeg_bytes).digest == decode_image(png).digest
    as_jpeg = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(jpeg_bytes, "image/jpeg")}},
        {"type": "text", "text": "Read the chart."}]}]
    # LangChain v1 base64 block, PNG encoding of the same pixels
    as_png = [{"role": "user", "content": [
        {"type": "image", "base64": base64.b64encode(png).decode(), "mime_type": "image/png"},
        {"type": "text", "text": "Read the chart."}]}]
    p1 = enc.build_prompt(as_jpeg)
    p2 = enc.build_prompt(as_png)
    assert p1.key_ids == p2.key_ids
    runs = enc.encoder_runs
    first = greedy(vlm_engine, as_jpeg)
    second = vlm_engine.chat(as_png, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    assert second.token_ids == first
    assert second.usage.cached_tokens > 0 and enc.encoder_runs == runs + 1
    # One changed pixel is another image: another key, another encoder run.
    changed = decoded.copy()
    changed.putpixel((0, 0), (0, 0, 0) if decoded.getpixel((0, 0)) != (0, 0, 0) else (255, 255, 255))
    assert enc.build_prompt(ask("Read the chart.", changed)).key_ids != enc.build_prompt(ask("Read the chart.", decoded)).key_ids


def test_known_image_skips_the_processor_even_after_eviction(vlm_engine):
    """A prompt whose images were all processed before is built without the image processor (the
    image's token span spliced in): the same ids as the processor's; if its features were evicted by
    the time it prefills, the engine makes its pixel inputs then, and the tokens are still mlx-vlm's."""
    import numpy as np

    from parallm_engine.vision.inputs import extract_images

    enc = vlm_engine.model.vision
    image = chart(90)
    first = enc.build_prompt(ask("What is the first bar?", image))
    assert first.image_inputs[0] is not None  # a new image: processed
    # A system message before the image: the radix tree has no prefix through it, so its rows prefill.
    msgs = [{"role": "system", "content": "You read charts."}, *ask("What is the last bar?", image)]
    known = enc.build_prompt(msgs)
    if enc.family == "gemma3":
        # Its processor wraps the image in "\n\n", which merges with the text's newlines: splicing the
        # span cannot give the processor's ids, so every prompt goes through the processor.
        assert enc._splice_ok is False and known.image_inputs[0] is not None
    else:
        assert known.image_inputs == [None] and enc._splice_ok is True
    stripped, images = extract_images(msgs)
    own = enc.processor(text=[enc._render(stripped, None, 1, {})], images=[im.image for im in images])
    assert known.token_ids == np.array(own["input_ids"])[0].tolist()
    enc.clear()  # the features are gone: the engine thread processes the image itself
    runs = enc.encoder_runs
    assert greedy(vlm_engine, msgs) == reference(vlm_engine, msgs)
    assert enc.encoder_runs == runs + 1


def test_8_concurrent_on_one_image_encode_once(vlm_engine):
    from parallm_engine.vision.chat import chat_prompt

    enc = vlm_engine.model.vision
    image = chart(60)
    convs = [ask(f"Question {i}: what does bar {i % 4} show?", image) for i in range(8)]
    runs = enc.encoder_runs
    results = vlm_engine.generate([chat_prompt(vlm_engine, m, None, {}) for m in convs],
                                  max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    assert enc.encoder_runs == runs + 1
    assert sum(1 for r in results if r.usage.cached_tokens > 0) >= 7  # the image's prefix computed once
    for conv, res in zip(convs[:3], results[:3]):
        assert res.token_ids == reference(vlm_engine, conv)


def test_running_stream_decodes_while_an_image_is_encoded(vlm_engine):
    """The vision encoder runs off the engine thread: while it is held up (here: waiting for the image
    processor, which the test holds), a running text stream keeps receiving tokens; then the image
    request completes with mlx-vlm's tokens."""
    import contextlib
    import time

    from parallm_engine.errors import RequestCancelledError
    from parallm_engine.vision.chat import chat_prompt

    enc = vlm_engine.model.vision
    msgs = ask("What is the middle bar?", chart(110))
    prompt = chat_prompt(vlm_engine, msgs, None, {})
    prompt.image_inputs = [None] * len(prompt.images)  # a known image: the worker re-runs the processor
    enc.clear()
    text = vlm_engine.submit(vlm_engine.encode("Count slowly:"), max_tokens=400, temperature=0.0,
                             ignore_eos=True)
    got: list[float] = []

    def consume():
        with contextlib.suppress(RequestCancelledError):
            for _ in text:
                got.append(time.monotonic())

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    try:
        with enc._lock:  # the worker's processor call waits for this
            image = vlm_engine.submit(prompt, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
            start = len(got)
            deadline = time.monotonic() + 60
            while len(got) < start + 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(got) >= start + 20  # the engine thread was not waiting on the encoder
            assert not image.request.finished and image.request.first_token_time is None
        tokens = [t for delta in image for t in delta.token_ids]
    finally:
        text.abort()
        reader.join(30)
    assert tokens == reference(vlm_engine, msgs)


def test_abort_while_the_image_is_encoded(vlm_engine):
    """A request aborted while its image waits for the encoder ends cancelled once encoded, and frees its
    queue slot; a failing encode fails that request alone, with a typed error."""
    import time

    import mlx.core as mx
    import numpy as np

    from parallm_engine.errors import RequestCancelledError
    from parallm_engine.vision.chat import chat_prompt

    enc = vlm_engine.model.vision
    prompt = chat_prompt(vlm_engine, ask("Which bar?", chart(120)), None, {})
    prompt.image_inputs = [None] * len(prompt.images)  # the worker re-runs the processor (held below)
    enc.clear()
    with enc._lock:
        handle = vlm_engine.submit(prompt, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
        handle.abort()
    with pytest.raises(RequestCancelledError):
        for _ in handle:
            pass
    deadline = time.monotonic() + 30
    while vlm_engine.stats()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert vlm_engine.stats()["in_flight"] == 0
    broken = chat_prompt(vlm_engine, ask("Which bar?", chart(121)), None, {})
    # pixels of 7 channels: the vision tower cannot read them
    pixels = mx.array(np.zeros((1, 7, 32, 32), np.float32))
    broken.image_inputs = [{**broken.image_inputs[0], "pixel_values": pixels}]
    with pytest.raises(ImageInputError, match="vision encoder failed"):
        vlm_engine.generate([broken], max_tokens=2)
    msgs = ask("Still fine?", chart(122))
    assert greedy(vlm_engine, msgs) == reference(vlm_engine, msgs)


def test_async_paths_prepare_images_off_the_event_loop(vlm_engine):
    """Engine.achat, ChatParaLLM.ainvoke and ParaLLMLlamaIndex.achat decode and process images on a worker
    thread: while the image processor is held up (the test holds its lock), the event loop keeps
    running; then each answer is mlx-vlm's."""
    import asyncio

    from langchain_core.messages import HumanMessage
    from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock

    from parallm_integrations import ChatParaLLM
    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    enc = vlm_engine.model.vision
    path = str(vlm_engine.model_info.path)
    q = "What is the first bar?"
    images = [chart(130), chart(131), chart(132)]
    lc = ChatParaLLM(model=path, temperature=0.0, max_tokens=N_TOKENS)
    li = ParaLLMLlamaIndex(model=path, temperature=0.0, max_tokens=N_TOKENS)
    calls = [
        lambda: vlm_engine.achat(ask(q, images[0]), max_tokens=N_TOKENS, temperature=0.0),
        lambda: lc.ainvoke([HumanMessage(content=[
            {"type": "image_url", "image_url": {"url": data_url(png_bytes(images[1]))}},
            {"type": "text", "text": q}])]),
        lambda: li.achat([ChatMessage(role="user", blocks=[
            ImageBlock(image=png_bytes(images[2]), image_mimetype="image/png"), TextBlock(text=q)])]),
    ]

    async def one(call) -> tuple[int, object]:
        ticks = 0
        enc._lock.acquire()  # the image processor waits for this
        try:
            task = asyncio.ensure_future(call())
            for _ in range(20):
                await asyncio.sleep(0.01)
                ticks += 1
            assert not task.done()
        finally:
            enc._lock.release()
        return ticks, await asyncio.wait_for(task, 60)

    async def main():
        return [await one(c) for c in calls]

    (t1, r1), (t2, r2), (t3, r3) = asyncio.run(main())
    assert t1 == t2 == t3 == 20
    want = [vlm_engine.tokenizer.decode(reference(vlm_engine, ask(q, im))) for im in images]
    assert r1.token_ids == reference(vlm_engine, ask(q, images[0]))
    assert r2.content == want[1] and r3.message.content == want[2]


def test_langchain_v0_block_and_several_images_in_two_messages(vlm_engine):
    a, b = png_bytes(chart(70)), png_bytes(chart(71))
    msgs = [
        {"role": "user", "content": [{"type": "image", "source_type": "base64", "data": base64.b64encode(a).decode(),
                                      "mime_type": "image/png"}, {"type": "text", "text": "First chart."}]},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": [{"type": "image", "image": b}, {"type": "text", "text": "And this one?"}]},
    ]
    assert greedy(vlm_engine, msgs) == reference(vlm_engine, msgs)


def test_typed_errors_and_engine_survives(vlm_engine):
    enc = vlm_engine.model.vision
    bad = [
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml")}}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(b"%PDF-1.4 not an image")}}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
        [{"role": "user", "content": [{"type": "audio", "data": "AAAA"}, {"type": "image", "image": png_bytes(chart(1))}]}],
    ]
    for msgs in bad:
        with pytest.raises(ImageInputError):
            vlm_engine.chat(msgs, max_tokens=2)
    enc.max_image_pixels = 100
    try:
        with pytest.raises(ImageInputError, match="pixels"):
            vlm_engine.chat(ask("big?", chart(1)), max_tokens=2)
    finally:
        enc.max_image_pixels = None
    assert issubclass(ImageInputError, InvalidRequestError)
    msgs = ask("Still fine?", chart(80))
    assert greedy(vlm_engine, msgs) == reference(vlm_engine, msgs)


def test_remote_image_only_when_allowed(vlm_engine):
    body = png_bytes(chart(90))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/chart.png"
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is it?"}]}]
        with pytest.raises(ImageInputError, match="allow_remote_images"):
            vlm_engine.chat(msgs, max_tokens=2)
        got = vlm_engine.chat(msgs, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True,
                              allow_remote_images=True).token_ids
        assert got == reference(vlm_engine, ask("What is it?", chart(90)))
    finally:
        server.shutdown()


def test_images_to_a_text_model_are_refused(tiny_engine):
    with pytest.raises(ImageInputError, match="no vision"):
        tiny_engine.chat(ask("What is this?", chart(1)), max_tokens=2)


def test_unsupported_vlm_runs_text_only_and_refuses_images(tmp_path):
    """A Mistral 3 checkpoint whose language model is Ministral 3 (attention scaled by a position factor
    mlx-vlm takes from the first row only) loads text-only through mlx-lm: text requests are the
    model's own tokens; image requests get a typed error that says why."""
    import json

    from mlx_lm.utils import load as mlx_load

    from parallm_engine import Engine
    from tests.model_zoo import build, default_tokenizer, reference_greedy

    tok_dir, vocab = default_tokenizer()
    path = build("ministral3", tmp_path / "ministral3vl", tok_dir, vocab)
    text = json.loads((path / "config.json").read_text())
    config = {"model_type": "mistral3", "text_config": text, "image_token_index": vocab - 1,
              "vision_config": {"model_type": "pixtral", "hidden_size": 32}}
    (path / "config.json").write_text(json.dumps(config))
    eng = Engine(str(path))
    try:
        assert getattr(eng.model, "vision", None) is None
        with pytest.raises(ImageInputError, match="position-dependent factor") as err:
            eng.chat(ask("What is this?", chart(1)), max_tokens=2)
        assert "mistral3" in str(err.value) and "ministral3" in str(err.value)
        ids = eng.encode("Tell me about charts.")
        got = eng.generate([ids], max_tokens=8, temperature=0.0, ignore_eos=True)[0].token_ids
        model, _ = mlx_load(str(path))
        assert got == reference_greedy(model, ids, 8)
    finally:
        eng.shutdown()


# -- M-RoPE (Qwen2-VL / Qwen2.5-VL / Qwen3-VL): every row its own 3-D positions and rope delta ------------
def test_mrope_batch_of_different_grids_and_text_equals_alone(mrope_engine):
    """One batch: images of different grids (so different rope deltas), two images in one prompt, and a
    text-only request; each answer equals that request alone through mlx-vlm (whose model object keeps
    one rope delta for the whole batch)."""
    from parallm_engine.vision.chat import chat_prompt

    convs = [ask("What is the max?", chart(140)),
             ask("What is the max?", chart(141, size=(64, 24))),
             ask("Compare them.", chart(142, size=(24, 56)), chart(143)),
             [{"role": "user", "content": "Tell me a story about bars."}],
             ask("Which colour?", chart(144, size=(40, 40)))]
    prompts = [chat_prompt(mrope_engine, m, None, {}) for m in convs]
    deltas = {p.rope_delta for p in prompts if hasattr(p, "rope_delta")}
    assert len(deltas) >= 3  # the rows really need different positions
    results = mrope_engine.generate(prompts, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    for conv, res in zip(convs, results):
        assert res.token_ids == reference(mrope_engine, conv)


def test_mrope_positions_of_any_window_are_the_prompts(mrope_engine):
    """Every window of positions the engine passes (a decode / verification block starting at any KV
    length, a left-padded prefill chunk starting anywhere) is the slice of mlx-vlm's ``get_rope_index``
    on the prompt followed by the answer: image grids inside the prompt, index + rope delta after it."""
    from types import SimpleNamespace

    import numpy as np

    from parallm_engine.vision.mrope import decode_positions, image_grid, prefill_positions, prompt_positions

    enc = mrope_engine.model.vision
    prompt = enc.build_prompt(ask("Compare them.", chart(170, size=(64, 24)), chart(171)))
    L, W = len(prompt.token_ids), 3
    # the prompt and 4 answer tokens, as the model would see them in one forward
    grids = [image_grid(inp) for inp in prompt.image_inputs]  # new images: processed
    full, delta = prompt_positions(enc.vlm, prompt.token_ids + [1, 2, 3, 4], grids)
    assert delta == prompt.rope_delta != 0 and (full[:, :L] == prompt.mrope).all()
    for k in range(L + 4 - W + 1):
        seq = SimpleNamespace(request=SimpleNamespace(vision=prompt), computed=k, output_ids=[1, 2, 3, 4])
        assert (np.array(decode_positions([seq], W))[:, 0] == full[:, k:k + W]).all(), k
        padded = np.array(prefill_positions([(seq, k, W)], W + 2))[:, 0]
        assert (padded[:, 2:] == full[:, k:k + W]).all(), k


def test_mrope_chunked_prefill_and_prefix_hit_equal_cold(mrope_engine):
    """Prefill in 5-token chunks (chunks start mid-image and after it: each takes its own columns of the
    prompt's positions); a second question on the same image resumes after the cached prefix; a
    preempted-and-resumed or cache-hit row continues at its own positions. All equal mlx-vlm's."""
    from parallm_engine import Engine

    eng = Engine(str(mrope_engine.model_info.path), prefill_chunk=5)
    try:
        system = {"role": "system", "content": "You read charts."}
        first = [system, *ask("What is the first bar?", chart(150, size=(56, 40)))]
        assert greedy(eng, first) == reference(eng, first)
        second = [system, *ask("And the last bar?", chart(150, size=(56, 40)))]
        warm = eng.chat(second, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
        assert warm.usage.cached_tokens > 0 and warm.token_ids == reference(eng, second)
        # The next turn: the whole first exchange (image and answer, at their positions) is the prefix.
        answer = eng.tokenizer.decode(greedy(eng, first))
        turn = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
        again = eng.chat(turn, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
        assert again.token_ids == reference(eng, turn)
    finally:
        eng.shutdown()


def test_mrope_speculative_verification_equals_plain(mrope_engine):
    """n-gram speculation verifies W > 1 positions per row in one forward: each row's block continues
    its own positions (its rope delta included), so greedy output is unchanged."""
    from parallm_engine.vision.chat import chat_prompt

    convs = [ask("Repeat: red blue red blue red blue red blue", chart(160, size=(64, 24))),
             ask("Repeat: one two one two one two", chart(161))]
    prompts = [chat_prompt(mrope_engine, m, None, {}) for m in convs]
    before = mrope_engine.stats()["spec_steps"]
    spec = mrope_engine.generate(prompts, max_tokens=40, temperature=0.0, ignore_eos=True,
                                 speculative={"method": "ngram", "num_tokens": 4, "min_match": 1, "adaptive": False})
    assert mrope_engine.stats()["spec_steps"] > before  # verification forwards of W > 1 ran
    for conv, res in zip(convs, spec):
        assert res.token_ids == reference(mrope_engine, conv, 40)


def test_langchain_image_blocks(vlm_engine):
    from langchain_core.messages import HumanMessage

    from parallm_integrations import ChatParaLLM

    img = png_bytes(chart(100))
    b64 = base64.b64encode(img).decode()
    want = vlm_engine.chat(ask("What is the trend?", chart(100)), max_tokens=N_TOKENS, temperature=0.0).text
    llm = ChatParaLLM(model=str(vlm_engine.model_info.path), temperature=0.0, max_tokens=N_TOKENS)
    for block in ({"type": "image_url", "image_url": {"url": data_url(img)}},
                  {"type": "image", "base64": b64, "mime_type": "image/png"},
                  {"type": "image", "source_type": "base64", "data": b64, "mime_type": "image/png"}):
        msg = HumanMessage(content=[block, {"type": "text", "text": "What is the trend?"}])
        assert llm.invoke([msg]).content == want
    remote = HumanMessage(content=[{"type": "image", "url": "https://example.com/x.png"},
                                   {"type": "text", "text": "?"}])
    with pytest.raises(ImageInputError):
        llm.invoke([remote])


def test_llama_index_image_block(vlm_engine):
    from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock

    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    want = vlm_engine.chat(ask("Describe it.", chart(101)), max_tokens=N_TOKENS, temperature=0.0).text
    llm = ParaLLMLlamaIndex(model=str(vlm_engine.model_info.path), temperature=0.0, max_tokens=N_TOKENS)
    msg = ChatMessage(role="user", blocks=[ImageBlock(image=png_bytes(chart(101)), image_mimetype="image/png"),
                                           TextBlock(text="Describe it.")])
    assert llm.chat([msg]).message.content == want


def test_server_image_url_parts(vlm_engine):
    import httpx

    from parallm_engine.serve.server import ServerThread, create_app

    msgs = ask("What colour dominates?", chart(102))
    want = vlm_engine.chat(msgs, max_tokens=N_TOKENS, temperature=0.0).text
    with ServerThread(create_app(engine=vlm_engine)) as srv:
        body = {"model": vlm_engine.model_name, "messages": msgs, "max_tokens": N_TOKENS, "temperature": 0.0}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
        bad = {**body, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=bad, timeout=60)
        assert r.status_code == 400 and "image" in r.text
