"""Images in the conversation: tiny random-weight VLMs of two mlx-vlm families (LLaVA, Idefics3/SmolVLM)
built here, images drawn with PIL. The engine's greedy tokens must equal mlx-vlm's own generation
(``generate_step`` on the processor's inputs), batched or alone, cold or from the image caches."""

from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from PIL import Image, ImageDraw

from parallm_engine import Engine  # noqa: F401
from parallm_engine.errors import ImageInputError, InvalidRequestError
from parallm_engine.vision_inputs import decode_image
from parallm_engine.vision_tiny import build_tiny_vlm

FAMILIES = ["llava", "idefics3"]
N_TOKENS = 10


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


@pytest.fixture(scope="module", params=FAMILIES)
def vlm_engine(request, tmp_path_factory):
    from parallm_engine import get_engine

    path = build_tiny_vlm(request.param, tmp_path_factory.mktemp(request.param))
    return get_engine(str(path))  # the shared engine: ChatParaLLM(model=path) finds the same one


def reference(eng: Engine, messages: list[dict], n: int = N_TOKENS) -> list[int]:
    """mlx-vlm's own greedy generation on the processor's inputs for the same rendered chat."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    from parallm_engine.vision_inputs import extract_images

    enc = eng.model.vision
    stripped, images = extract_images(messages)
    text = enc._render(stripped, None, len(images), {})
    if images:
        inputs = enc.processor(text=[text], images=[im.image for im in images])
    else:
        inputs = {"input_ids": mx.array([enc.tokenizer.encode(text, add_special_tokens=False)])}
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "pixel_values")}
    out = []
    for tok, _ in generate_step(inputs["input_ids"], enc.vlm, inputs.get("pixel_values"), None,
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
    from parallm_engine.vision import VisionPrompt  # noqa: F401  (chat prompts are submitted together)
    from parallm_engine.vision_chat import chat_prompt

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

    from parallm_engine.vision_inputs import extract_images

    enc = vlm_engine.model.vision
    image = chart(90)
    first = enc.build_prompt(ask("What is the first bar?", image))
    assert first.image_inputs[0] is not None  # a new image: processed
    # A system message before the image: the radix tree has no prefix through it, so its rows prefill.
    msgs = [{"role": "system", "content": "You read charts."}, *ask("What is the last bar?", image)]
    known = enc.build_prompt(msgs)
    assert known.image_inputs == [None] and enc._splice_ok is True
    stripped, images = extract_images(msgs)
    own = enc.processor(text=[enc._render(stripped, None, 1, {})], images=[im.image for im in images])
    assert known.token_ids == np.array(own["input_ids"])[0].tolist()
    enc.clear()  # the features are gone: the engine thread processes the image itself
    runs = enc.encoder_runs
    assert greedy(vlm_engine, msgs) == reference(vlm_engine, msgs)
    assert enc.encoder_runs == runs + 1


def test_8_concurrent_on_one_image_encode_once(vlm_engine):
    from parallm_engine.vision_chat import chat_prompt

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

    from parallm_engine.server import ServerThread, create_app

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
