"""Vision-language models (mlx-vlm) on the engine: loading, image prompts, the vision-feature cache, and
the prefill hook that feeds image rows to the language model.

How an image request runs:

1. Caller thread (:meth:`VisionEncoder.build_prompt`): the images are decoded and hashed
   (``vision_inputs``), the chat is rendered with the model's template, and mlx-vlm's processor expands
   each image placeholder into the model's image tokens (``token_ids``: what the model reads). Each
   image also goes through the processor alone, which gives its pixel inputs and its number of rows.
   The radix-tree key (``key_ids``) is ``token_ids`` with every image-token position replaced by an id
   derived from that image's pixel hash (outside the vocabulary), so two different images never share
   a key and the same picture in any encoding does. Each image's token span is remembered by pixel
   hash: once splicing spans into the tokenized prompt has reproduced the processor's ids for this
   model, a prompt whose images were all seen before skips the image processor entirely. M-RoPE models
   (Qwen-VL) also get the prompt's 3-D positions and rope delta here (``vision_mrope``).
2. Before the scheduler (``Engine.submit`` -> ``vision_worker``): each image's features come from the
   per-image cache (keyed by pixel hash, LRU under a byte budget) or, on a miss, from mlx-vlm's own
   ``get_input_embeddings`` on the image alone (vision tower + projector, exactly its merge), run on the
   vision worker thread with its own MLX stream; the request reaches the scheduler once they are ready,
   so running streams keep decoding meanwhile.
3. Engine thread (:func:`prefill_inputs`, which every prefill forward asks, ``runner.forward``): rows of a
   sequence with images get embeddings instead of token ids: the language model's own token
   embeddings, with image positions replaced by the image's vision features. A prompt whose image and
   text up to it are already in the radix tree skips both the encoder and the prefill. M-RoPE models
   get every row's own positions (and Qwen3-VL its DeepStack rows): ``vision_mrope``.
4. Decoding is the language model's own forward on token ids, batched with text requests (M-RoPE
   models: with each row's positions, through the ``decode_kwargs`` hook that ``runner.forward.decode`` asks).

Families: those whose language model uses plain 1-D positions and causal attention over image tokens,
so image rows are ordinary prompt rows: LLaVA, Idefics3 / SmolVLM, Pixtral and Mistral 3 (Mistral Small
3.1: [IMG] rows read features, [IMG_BREAK] / [IMG_END] are text), and Gemma 3 (mlx-vlm's gemma3 attends
causally over image tokens: the 4-D mask its merge builds is never passed to the language model; its
sliding-window layers run in the engine's "mixed" cache layout, ``make_cache`` below); and the M-RoPE
families Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE, whose image tokens take 3-D positions from
the image grid: the engine passes each row its own positions instead of mlx-vlm's batch-wide
``_rope_deltas`` (``vision_mrope``). Refused with a typed error that says why (``UNSUPPORTED_VISION``):
PaliGemma's prefix-LM attention, and Mistral 3 checkpoints with a Ministral 3 language model; their text
checkpoints still load text-only via mlx-lm.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from parallm_engine.errors import ImageInputError, ModelLoadError
from parallm_engine.vision.inputs import DecodedImage, extract_images
from parallm_engine.vision.mrope import (MROPE_FAMILIES, decode_positions, deepstack_inputs, image_grid, prefill_positions,
                           prompt_positions)

#: Families ParaLLM runs with images (model_type in config.json).
VISION_FAMILIES = ("llava", "idefics3", "smolvlm", "mistral3", "pixtral", "gemma3") + MROPE_FAMILIES
#: Vision families the engine cannot batch correctly yet, and why (their text checkpoints still load
#: text-only through mlx-lm; image requests get an ImageInputError with this reason).
UNSUPPORTED_VISION = {
    "paligemma": "prefix-LM attention: the prompt, image included, attends bidirectionally",
}
#: mistral3 checkpoints whose language model is not plain Mistral: Ministral 3 scales attention by a
#: position-dependent factor that mlx-vlm computes from the first row's offset only (wrong for a batch).
_MISTRAL3_TEXT = ("mistral",)
#: Radix-key ids of image positions start here (far above any vocabulary).
IMAGE_KEY_BASE = 1 << 40
DEFAULT_FEATURE_CACHE_BYTES = 256 << 20
#: Images whose token span is remembered (a few hundred ints each), so a prompt whose images were all
#: seen before skips the image processor.
MAX_KNOWN_SPANS = 1024


def vision_family(path: Path) -> str | None:
    """The model_type of a vision checkpoint ParaLLM runs with images; None for text models (and for
    vision families it does not support: mlx-lm loads those text-only)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    mtype = config.get("model_type")
    if mtype not in VISION_FAMILIES or "vision_config" not in config or unsupported_vision(config):
        return None
    return mtype


def unsupported_vision(config: dict) -> str | None:
    """Why the engine refuses images for this checkpoint's config (None: it does not, or the model has
    no vision tower)."""
    mtype = config.get("model_type")
    if "vision_config" not in config:
        return None
    if mtype in UNSUPPORTED_VISION:
        return UNSUPPORTED_VISION[mtype]
    text_type = (config.get("text_config") or {}).get("model_type", "mistral")
    if mtype == "mistral3" and text_type not in _MISTRAL3_TEXT:
        return (f"its {text_type} language model scales attention by a position-dependent factor that "
                "mlx-vlm computes from the first row's position only, which is wrong for a batch")
    return None


def unsupported_vision_reason(path) -> str | None:
    """:func:`unsupported_vision` for a checkpoint directory."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    reason = unsupported_vision(config)
    return f"{config.get('model_type')}: {reason}" if reason else None


def load_vision_model(path: Path):
    """(engine model, mlx-lm tokenizer) for a vision checkpoint, through mlx-vlm's own loader."""
    try:
        from mlx_vlm import load as vlm_load
    except ImportError as exc:
        raise ModelLoadError(
            f"{path} is a vision-language model; install the vision extra: pip install 'parallm-engine[vision]'"
        ) from exc
    from mlx_lm.utils import load_tokenizer

    try:
        vlm, processor = vlm_load(str(path))
    except Exception as exc:
        raise ModelLoadError(f"mlx-vlm could not load {path}: {exc}") from exc
    # Evaluated here, on the loading thread: a lazy array left in the tower (e.g. a rotary table)
    # would belong to this thread's stream, which the engine / encoder threads cannot evaluate.
    _materialize(vlm)
    _eval_each_linear(vlm)
    tokenizer = load_tokenizer(Path(path), eos_token_ids=getattr(vlm.config, "eos_token_id", None))
    encoder = VisionEncoder(vlm, processor, tokenizer)
    return VisionLanguageModel(vlm.language_model, encoder, mrope=encoder.family in MROPE_FAMILIES), tokenizer


def _materialize(vlm) -> None:
    """Evaluate every array the model holds, its parameters and the tables its helper objects keep
    (pixtral's rotary table is a plain object's attribute, built lazily at construction)."""
    arrays = [vlm.parameters()]
    for module in vlm.modules():
        for value in vars(module).values():
            if isinstance(value, mx.array):
                arrays.append(value)
            elif hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)):
                arrays += [v for v in vars(value).values() if isinstance(v, mx.array)]
    mx.eval(arrays)


_EVAL_AFTER: dict[type, type] = {}


def _eval_each_linear(vlm) -> None:
    """Make the vision tower's and projector's linear layers (this model's instances only) evaluate their
    output at once. MLX throttles evaluation process-wide (a thread waits while more than ~10 tasks of any
    stream are in flight): a whole tower evaluated in one ``mx.eval`` keeps ~10 of its big matmuls queued
    for seconds, and the engine thread's decode step waits behind them. One matmul in flight at a time
    leaves the decode room, so running streams keep decoding while an image is encoded (same values)."""
    for name, module in vlm.named_modules():
        if name.startswith("language_model") or not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
            continue
        cls = type(module)
        sub = _EVAL_AFTER.get(cls)
        if sub is None:
            def __call__(self, x, _base=cls.__call__):
                y = _base(self, x)
                mx.eval(y)
                return y
            sub = _EVAL_AFTER[cls] = type(f"EvalAfter{cls.__name__}", (cls,), {"__call__": __call__})
        module.__class__ = sub


class VisionLanguageModel(nn.Module):
    """The engine's view of a VLM: its language model, called like an mlx-lm model (token ids and
    caches in, logits out), optionally with input embeddings; ``vision`` holds the rest (not a child
    module: the engine's kernels and dtype conversion touch only the language model)."""

    def __init__(self, language_model: nn.Module, encoder: "VisionEncoder", mrope: bool = False):
        super().__init__()
        self.language_model = language_model
        self.vision = encoder
        self.mrope = mrope  # every forward gets per-row position_ids (vision_mrope)

    @property
    def layers(self):
        return self.language_model.layers

    def make_cache(self) -> list:
        """The language model's own per-layer caches, as the mlx-lm classes the engine batches (mlx-vlm
        keeps its own copies of KVCache / RotatingKVCache); any other kind is passed through, and the
        engine refuses it at load (``model_caches.cache_layout``)."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        make = getattr(self.language_model, "make_cache", None)
        if make is None:
            return [KVCache() for _ in self.layers]
        out = []
        for c in make():
            kind = type(c).__name__
            if kind == "KVCache":
                out.append(KVCache())
            elif kind == "RotatingKVCache":
                out.append(RotatingKVCache(max_size=c.max_size, keep=c.keep))
            else:
                out.append(c)
        return out

    def embed(self, ids: mx.array) -> mx.array:
        return self.vision.vlm.get_input_embeddings(input_ids=ids).inputs_embeds

    def prefill_inputs(self, tokens: mx.array, rows: list[tuple]) -> tuple[mx.array, dict]:
        """A prefill forward's token ids and keyword arguments (``prefill_inputs`` below): image rows'
        embeddings, M-RoPE positions."""
        return prefill_inputs(self, tokens, rows)

    def decode_kwargs(self, seqs: list, width: int) -> dict:
        """Extra arguments of a decode forward of ``seqs`` over ``width`` positions per row (the hook
        ``runner.forward.decode`` asks): an M-RoPE model's per-row positions."""
        return {"position_ids": decode_positions(seqs, width)} if self.mrope else {}

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None, **kwargs):
        """``kwargs``: an M-RoPE model's ``position_ids`` (and Qwen3-VL's DeepStack inputs: vision_mrope)."""
        out = self.language_model(inputs, inputs_embeds=input_embeddings, cache=cache, **kwargs)
        return getattr(out, "logits", out)


@dataclass
class VisionPrompt:
    """A chat prompt with images, as :meth:`Engine.submit` takes it (see the module docstring)."""

    token_ids: list[int]
    key_ids: list[int]
    images: list[DecodedImage]
    row_index: np.ndarray  # per token: -1, or the row of the concatenated image features it reads
    # per image: the processor's outputs for it alone; None for an image processed before (made on the
    # engine thread if its features are needed and no longer cached)
    image_inputs: list[dict | None] = field(repr=False, default_factory=list)
    # per image: its features (evaluated), set before the request reaches the scheduler (the vision
    # worker, or the cache at submit)
    feature_parts: list | None = field(repr=False, default=None)
    features: Any = field(repr=False, default=None)  # engine thread: (rows, hidden), once computed
    # M-RoPE models (vision_mrope): the prompt's (3, len) positions and the offset of every later token
    mrope: np.ndarray | None = field(repr=False, default=None)
    rope_delta: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)


class VisionEncoder:
    """mlx-vlm's vision tower, projector and processor for one model, with the image-feature cache.

    Counters (read them with :meth:`stats`): ``encoder_runs`` (vision tower runs, one per image not
    cached), ``feature_hits`` (images whose features came from the cache)."""

    def __init__(self, vlm, processor, tokenizer, budget_bytes: int = DEFAULT_FEATURE_CACHE_BYTES):
        self.vlm = vlm
        self.processor = processor
        self.tokenizer = tokenizer
        cfg = vlm.config
        self.image_token_id = int(getattr(cfg, "image_token_index", None) or getattr(cfg, "image_token_id"))
        # The marker the chat shows for one image, which the processor expands into the image's tokens:
        # the image token itself, or (Gemma 3) the begin-of-image token.
        marker = getattr(processor, "boi_token", None) if cfg.model_type == "gemma3" else None
        self.image_token = marker or getattr(processor, "image_token", None) or "<image>"
        self.family = cfg.model_type
        self.budget_bytes = budget_bytes
        self.allow_remote_images = False
        self.max_image_pixels: int | None = None
        self._cache: OrderedDict[bytes, mx.array] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()  # the processor (tokenizer + image processor) across caller threads
        self._cache_lock = threading.Lock()  # the feature cache: caller, worker and engine threads
        self.worker = None  # vision_worker.VisionWorker, made on first use
        # Per pixel hash: the image's token span (LRU). ``_splice_ok``: whether splicing spans into the
        # tokenized prompt gave the processor's own ids (None: not checked yet; False: never splice).
        self._spans: OrderedDict[bytes, list[int]] = OrderedDict()
        self._grids: dict[bytes, np.ndarray] = {}  # per pixel hash: an M-RoPE image's (t, h, w) grid
        self._splice_ok: bool | None = None
        self._frame: list[int] | None = None  # the tokenizer's ids for the image marker alone
        self._marker_id: int | None = None  # the marker's own token id
        self.encoder_runs = 0
        self.feature_hits = 0
        self.last_encode: tuple[float, float] | None = None  # (start, end), time.monotonic(), of the last run

    # -- caller thread --------------------------------------------------------------------------
    def build_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                     allow_remote_images: bool | None = None, **template_kwargs) -> VisionPrompt:
        remote = self.allow_remote_images if allow_remote_images is None else bool(allow_remote_images)
        stripped, images = extract_images(messages, allow_remote=remote, max_pixels=self.max_image_pixels)
        text = self._render(stripped, tools, len(images), template_kwargs)
        mrope = self.family in MROPE_FAMILIES
        with self._lock:
            known = [self._spans.get(im.digest) for im in images]
            grids = [self._grids.get(im.digest) for im in images]
        token_ids = self._spliced(text, known) if self._splice_ok and all(k is not None for k in known) and not (
            mrope and any(g is None for g in grids)) else None
        if token_ids is not None:
            # Every image seen before: no image processing at all. Its pixel inputs are made on the engine
            # thread only if its features are gone from the cache by then (see ``_image_features``).
            inputs: list[dict | None] = [None] * len(images)
            counts = [sum(1 for t in span if t == self.image_token_id) for span in known]
        else:
            token_ids, inputs, counts = self._process(text, images)
            grids = [image_grid(inp) for inp in inputs] if mrope else grids
        positions = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if sum(counts) != len(positions):
            raise ImageInputError(
                f"the processor gave {len(positions)} image tokens for the prompt but {sum(counts)} for its "
                f"{len(images)} image(s) alone; this model's image layout is not supported", param="messages")
        key_ids = list(token_ids)
        row_index = np.full(len(token_ids), -1, dtype=np.int64)
        at = 0
        for image, n in zip(images, counts):
            key = IMAGE_KEY_BASE + int.from_bytes(image.digest[:6], "big")
            for p in positions[at: at + n]:
                key_ids[p] = key
                row_index[p] = at
                at += 1
        if token_ids and row_index[-1] >= 0:
            raise ImageInputError("the prompt must not end with an image (add text or a generation prompt)",
                                  param="messages")
        prompt = VisionPrompt(token_ids, key_ids, images, row_index, inputs)
        if mrope:  # the prompt's own 3-D positions (vision_mrope)
            prompt.mrope, prompt.rope_delta = prompt_positions(self.vlm, token_ids, grids)
        return prompt

    def _process(self, text: str, images: list[DecodedImage]) -> tuple[list[int], list[dict], list[int]]:
        """mlx-vlm's processor on the whole prompt (its token ids) and on each image alone (its pixel
        inputs and image-token span); records the spans, and whether splicing them reproduces the
        processor's ids for this model (then a prompt whose images are all known skips the processor)."""
        pil = [im.image for im in images]
        with self._lock:
            full = self.processor(text=[text], images=pil)
            alone = [self.processor(text=[self.image_token], images=[p]) for p in pil]
        token_ids = _ids(full["input_ids"])
        inputs, counts, spans = [], [], []
        for image, out in zip(images, alone):
            ids = _ids(out["input_ids"])
            counts.append(sum(1 for t in ids if t == self.image_token_id))
            extra = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
            inputs.append({"input_ids": mx.array([ids]), **extra})
            spans.append(self._span(ids))
        if self._splice_ok is not False and all(sp is not None for sp in spans):
            ok = self._spliced(text, spans) == token_ids
            self._splice_ok = ok if self._splice_ok is None else (self._splice_ok and ok)
        if self._splice_ok:
            with self._lock:
                for image, span, inp in zip(images, spans, inputs):
                    self._spans[image.digest] = span
                    self._spans.move_to_end(image.digest)
                    if "image_grid_thw" in inp:  # M-RoPE: the image's grid gives its tokens' positions
                        self._grids[image.digest] = image_grid(inp)
                while len(self._spans) > MAX_KNOWN_SPANS:
                    old, _ = self._spans.popitem(last=False)
                    self._grids.pop(old, None)
        return token_ids, inputs, counts

    def _text_ids(self, text: str) -> list[int]:
        """The processor's tokenizer on ``text``, as the processor calls it (special tokens added)."""
        tok = getattr(self.processor, "tokenizer", self.tokenizer)
        with self._lock:
            return _ids([tok(text)["input_ids"]])

    def _span(self, alone_ids: list[int]) -> list[int] | None:
        """One image's expansion: the processor's ids for the image token alone, less the special tokens
        the tokenizer adds around any text (BOS ...); None if they do not frame it."""
        if self._frame is None:
            self._frame = self._text_ids(self.image_token)
            ids = self.tokenizer.convert_tokens_to_ids(self.image_token) if hasattr(
                self.tokenizer, "convert_tokens_to_ids") else None
            self._marker_id = ids if isinstance(ids, int) else None
        frame = self._frame
        if self._marker_id is None or frame.count(self._marker_id) != 1:
            return None
        cut = frame.index(self._marker_id)
        head, tail = frame[:cut], frame[cut + 1:]
        if alone_ids[:len(head)] != head or (tail and alone_ids[-len(tail):] != tail):
            return None
        return alone_ids[len(head): len(alone_ids) - len(tail)]

    def _spliced(self, text: str, spans: list[list[int]]) -> list[int] | None:
        """The prompt's ids with each image token replaced by its image's span (what the processor does:
        expand the image token, then tokenize; the image markers are special tokens, so the text
        between them tokenizes alike)."""
        ids = self._text_ids(text)
        if self._marker_id is None or ids.count(self._marker_id) != len(spans):
            return None
        out, it = [], iter(spans)
        for t in ids:
            out.extend(next(it) if t == self._marker_id else (t,))
        return out

    def _render(self, messages: list[dict], tools, n_images: int, template_kwargs: dict) -> str:
        """The chat template's text, one image token per image: the template's own image markers when it
        renders ``{"type": "image"}`` parts, else each image's token inline where the image was."""
        tok = getattr(self.processor, "tokenizer", self.tokenizer)
        kwargs = dict(tools=tools or None, add_generation_prompt=True, tokenize=False, **template_kwargs)
        try:
            text = tok.apply_chat_template(messages, **kwargs)
        except Exception:
            text = None
        if text is None or text.count(self.image_token) != n_images:
            flat = [{**m, "content": "".join(self.image_token if p.get("type") == "image" else p.get("text", "")
                                             for p in m["content"])} if isinstance(m.get("content"), list) else m
                    for m in messages]
            text = tok.apply_chat_template(flat, **kwargs)
        if text.count(self.image_token) != n_images:
            raise ImageInputError(f"the chat template dropped images ({text.count(self.image_token)} of "
                                  f"{n_images} rendered)", param="messages")
        return text

    # -- engine thread --------------------------------------------------------------------------
    # -- before the scheduler: the worker thread (vision_worker) -----------------------------------
    def needs_encoding(self, prompt: VisionPrompt) -> bool:
        """Whether the prompt has an image whose features are not cached. If all are cached, the prompt
        takes them now (a lookup: nothing runs) and the engine thread never waits on the encoder."""
        with self._cache_lock:
            parts = [self._cache.get(im.digest) for im in prompt.images]
            if any(p is None for p in parts):
                return True
            for im in prompt.images:
                self._cache.move_to_end(im.digest)
            self.feature_hits += len(parts)
        prompt.feature_parts = parts
        return False

    def encode_async(self, prompt: VisionPrompt, done) -> None:
        """Compute the prompt's image features on the worker thread, then ``done(error or None)``."""
        if self.worker is None:
            from parallm_engine.vision.worker import VisionWorker

            self.worker = VisionWorker(self)
        self.worker.submit(prompt, done)

    def encode_prompt(self, prompt: VisionPrompt) -> None:
        """Each image's features, from the cache or the vision tower (evaluated on the calling thread's
        stream); stored on the prompt for the engine thread."""
        prompt.feature_parts = [self._image_features(im, inp) for im, inp in zip(prompt.images, prompt.image_inputs)]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    # -- engine thread --------------------------------------------------------------------------
    def features(self, prompt: VisionPrompt) -> mx.array:
        """The prompt's image rows, (image tokens, hidden), in prompt order."""
        if prompt.features is None:
            if prompt.feature_parts is None:  # not submitted through the engine (or the worker is off)
                self.encode_prompt(prompt)
            parts = prompt.feature_parts
            prompt.features = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        return prompt.features

    def _image_features(self, image: DecodedImage, inputs: dict | None) -> mx.array:
        with self._cache_lock:
            hit = self._cache.get(image.digest)
            if hit is not None:
                self._cache.move_to_end(image.digest)
                self.feature_hits += 1
                return hit
        if inputs is None:  # a known image whose features were evicted since its prompt was built
            with self._lock:
                out = self.processor(text=[self.image_token], images=[image.image])
            extra = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
            inputs = {"input_ids": mx.array([_ids(out["input_ids"])]), **extra}
        ids = inputs["input_ids"]
        extra = {k: v for k, v in inputs.items() if k != "input_ids"}
        if self.family == "gemma3":  # its merge builds a (never used) 4-D mask from the attention mask
            extra["mask"] = mx.ones(ids.shape, dtype=mx.int32)
        t0 = time.monotonic()
        out = self.vlm.get_input_embeddings(input_ids=ids, **extra)
        rows = np.nonzero(np.array(ids[0]) == self.image_token_id)[0]
        feats = out.inputs_embeds[0][mx.array(rows)]
        deepstack = getattr(out, "deepstack_visual_embeds", None)
        if deepstack is not None:  # Qwen3-VL: each DeepStack layer's rows, side by side (vision_mrope)
            feats = mx.concatenate([feats, *[d.astype(feats.dtype) for d in deepstack]], axis=-1)
        mx.eval(feats)
        with self._cache_lock:
            self.last_encode = (t0, time.monotonic())
            self.encoder_runs += 1
            self._cache[image.digest] = feats
            self._cache_bytes += feats.nbytes
            while self._cache_bytes > self.budget_bytes and self._cache:  # budget 0: no feature cache
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.nbytes
        return feats

    def clear(self) -> None:
        with self._cache_lock:
            self._cache.clear()
            self._cache_bytes = 0

    def stats(self) -> dict:
        return {"encoder_runs": self.encoder_runs, "feature_hits": self.feature_hits,
                "cached_images": len(self._cache), "feature_cache_bytes": self._cache_bytes,
                "feature_cache_budget_bytes": self.budget_bytes}


def _ids(x) -> list[int]:
    arr = np.array(x)
    return [int(t) for t in (arr[0] if arr.ndim == 2 else arr)]


def prefill_inputs(model, tokens: mx.array, rows: list[tuple]) -> tuple[mx.array, dict]:
    """A prefill forward's inputs (``VisionLanguageModel.prefill_inputs``, which ``runner.forward.prefill``
    calls). ``rows``: one ``(sequence, start, n)`` per row of ``tokens`` (left-padded to
    ``tokens.shape[1]``): the row covers context positions ``[start, start + n)``. Rows of image requests
    read embeddings (their images' feature rows at image positions); an M-RoPE model gets every row's own
    positions. Returns the token ids and the model's keyword arguments."""
    B, L = tokens.shape
    # M-RoPE: every row's own positions, text rows included (the model must never derive them itself)
    kwargs = {"position_ids": prefill_positions(rows, L)} if getattr(model, "mrope", False) else {}
    if not any(getattr(seq.request, "vision", None) is not None for seq, _, _ in rows):
        return tokens, kwargs
    encoder: VisionEncoder = model.vision
    real = np.array(tokens)
    r_idx, c_idx, f_idx, feats, offset = [], [], [], [], 0
    for r, (seq, start, n) in enumerate(rows):
        vp = seq.request.vision
        if vp is None:
            continue
        context = vp.token_ids + seq.output_ids
        real[r, L - n:] = context[start: start + n]
        idx = vp.row_index[start: start + n]
        cols = np.nonzero(idx >= 0)[0]
        if len(cols) == 0:
            continue
        f = encoder.features(vp)
        r_idx += [r] * len(cols)
        c_idx += (L - n + cols).tolist()
        f_idx += (offset + idx[cols]).tolist()
        feats.append(f)
        offset += f.shape[0]
    ids = mx.array(real)
    embeds = model.embed(ids)
    if r_idx:
        rows_all = mx.concatenate(feats) if len(feats) > 1 else feats[0]
        picked = rows_all[mx.array(f_idx)].astype(embeds.dtype)
        H = embeds.shape[-1]
        embeds[mx.array(r_idx), mx.array(c_idx)] = picked[:, :H]
        if picked.shape[-1] > H:  # Qwen3-VL's DeepStack rows, in the batch's row-major image order
            kwargs.update(deepstack_inputs(picked, H, r_idx, c_idx, B, L))
    return ids, {**kwargs, "input_embeddings": embeds}
