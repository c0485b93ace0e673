"""Images in chat messages: find them, decode them (PIL), check them, hash their pixels.

MLX-free (PIL only): the server and the integrations can validate images without loading a model.

Accepted content parts (OpenAI, LangChain v0/v1, and ParaLLM's own):

* ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (or ``"image_url": "..."``)
* ``{"type": "image", "base64": "...", "mime_type": "image/png"}`` (LangChain v1)
* ``{"type": "image", "source_type": "base64", "data": "...", "mime_type": ...}`` (LangChain v0)
* ``{"type": "image", "url": "..."}`` / ``{"type": "image", "source_type": "url", "url": ...}``
* ``{"type": "image", "image": <PIL.Image | bytes>}``

``http(s)://`` URLs are fetched only with ``allow_remote=True`` (the engine is offline-first); local
paths and ``file://`` URLs are never read (a server must not open its own files for a client).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from typing import Any

from parallm_engine.errors import ImageInputError

#: Pixel limit of one image (width x height) unless the engine is told otherwise: 16 megapixels.
DEFAULT_MAX_IMAGE_PIXELS = 16_000_000
#: Bytes of one encoded image (base64-decoded) at most.
MAX_IMAGE_BYTES = 32 << 20
#: Formats PIL is asked to decode; anything else (SVG, PDF, HEIC, ...) is refused with a clear error.
SUPPORTED_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")

IMAGE_PART_TYPES = ("image_url", "image", "input_image")


@dataclass(frozen=True)
class DecodedImage:
    """One decoded RGB image and the SHA-256 of its pixels (mode, size and raw bytes): the same picture
    in any encoding (PNG, or JPEG decoded and re-encoded losslessly) has the same digest."""

    image: Any  # PIL.Image.Image, RGB
    digest: bytes

    @property
    def hex(self) -> str:
        return self.digest.hex()


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def has_images(messages: Any) -> bool:
    """Whether any message's content list holds an image part."""
    if not isinstance(messages, (list, tuple)):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, (list, tuple)) and any(is_image_part(p) for p in content):
            return True
    return False


def pixel_digest(image) -> bytes:
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    h = hashlib.sha256()
    h.update(f"RGB:{rgb.size[0]}x{rgb.size[1]}:".encode())
    h.update(rgb.tobytes())
    return h.digest()


def decode_image(source: Any, *, allow_remote: bool = False, max_pixels: int | None = None,
                 where: str = "image") -> DecodedImage:
    """Decode ``source`` (PIL image, bytes, data URL, bare base64, or with ``allow_remote`` an http(s)
    URL) to RGB and hash its pixels. Raises :class:`ImageInputError` (a 400) for anything else."""
    from PIL import Image

    limit = DEFAULT_MAX_IMAGE_PIXELS if max_pixels is None else int(max_pixels)
    if isinstance(source, Image.Image):
        img = source
    else:
        data = _image_bytes(source, allow_remote, where)
        if len(data) > MAX_IMAGE_BYTES:
            raise ImageInputError(f"{where}: encoded image is {len(data)} bytes; at most {MAX_IMAGE_BYTES}", param=where)
        try:
            # formats=: PIL tries only these decoders (no EPS/Ghostscript, no exotic plugins on untrusted bytes)
            with Image.open(io.BytesIO(data), formats=list(SUPPORTED_FORMATS)) as probe:
                w, h = probe.size
                if w * h > limit:
                    raise ImageInputError(
                        f"{where}: image is {w}x{h} = {w * h} pixels; the limit is {limit} (max_image_pixels)",
                        param=where)
                probe.load()
                img = probe.copy()
        except ImageInputError:
            raise
        except Image.DecompressionBombError as exc:
            raise ImageInputError(f"{where}: image too large to decode safely: {exc}", param=where) from exc
        except Exception as exc:
            raise ImageInputError(
                f"{where}: not a decodable image (supported formats: {', '.join(SUPPORTED_FORMATS)}): {exc}",
                param=where) from exc
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageInputError(f"{where}: image has no pixels", param=where)
    if w * h > limit:
        raise ImageInputError(f"{where}: image is {w}x{h} = {w * h} pixels; the limit is {limit} (max_image_pixels)",
                              param=where)
    rgb = img.convert("RGB")  # palette, alpha, greyscale, CMYK: the vision towers read RGB
    return DecodedImage(rgb, pixel_digest(rgb))


def _image_bytes(source: Any, allow_remote: bool, where: str) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if not isinstance(source, str):
        raise ImageInputError(f"{where}: expected image bytes, a data URL or base64 text, got {type(source).__name__}",
                              param=where)
    s = source.strip()
    if s.startswith("data:"):
        header, sep, payload = s.partition(",")
        if not sep:
            raise ImageInputError(f"{where}: malformed data URL (no ',')", param=where)
        mime = header[5:].split(";")[0].lower()
        if mime and not mime.startswith("image/"):
            raise ImageInputError(f"{where}: data URL has media type {mime!r}, not an image", param=where)
        if ";base64" not in header.lower():
            raise ImageInputError(f"{where}: only base64 data URLs are supported", param=where)
        return _b64(payload, where)
    if s.startswith(("http://", "https://")):
        if not allow_remote:
            raise ImageInputError(
                f"{where}: remote image URLs are not fetched (the engine is offline-first); send the image as "
                "base64 / a data URL, or opt in with allow_remote_images=True", param=where)
        return _fetch(s, where)
    if "://" in s[:16] or s.startswith("/"):
        raise ImageInputError(f"{where}: unsupported image URL scheme (use a data URL or base64)", param=where)
    return _b64(s, where)


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(f"{where}: invalid base64 image data: {exc}", param=where) from exc


def _fetch(url: str, where: str) -> bytes:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 (http/https only, checked above)
            data = resp.read(MAX_IMAGE_BYTES + 1)
    except Exception as exc:
        raise ImageInputError(f"{where}: could not fetch {url}: {exc}", param=where) from exc
    return data


def part_source(part: dict, where: str) -> Any:
    """The image payload of one content part (see the module docstring for the shapes)."""
    t = part.get("type")
    if t == "image_url" or t == "input_image":
        ref = part.get("image_url")
        if isinstance(ref, dict):
            ref = ref.get("url")
        if ref is None:
            ref = part.get("url")
        if not isinstance(ref, str):
            raise ImageInputError(f"{where}: image_url part needs image_url.url", param=where)
        return ref
    # "image": LangChain v1 (base64 / url / id) and v0 (source_type + data / url), or raw bytes / PIL
    if part.get("image") is not None:
        return part["image"]
    if part.get("base64") is not None:
        return part["base64"]
    if part.get("source_type") == "base64" or ("data" in part and part.get("source_type") is None):
        data = part.get("data")
        if data is None:
            raise ImageInputError(f"{where}: image part has no data", param=where)
        return data
    if part.get("url") is not None:
        return part["url"]
    if part.get("id") is not None or part.get("file_id") is not None:
        raise ImageInputError(f"{where}: images by provider file id are not supported; send base64", param=where)
    raise ImageInputError(f"{where}: image part has no image (expected base64, data or url)", param=where)


def extract_images(messages: list[dict], *, allow_remote: bool = False, max_pixels: int | None = None
                   ) -> tuple[list[dict], list[DecodedImage]]:
    """(messages whose image parts are ``{"type": "image"}`` markers, the decoded images in order)."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, (list, tuple)):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            if is_image_part(part):
                where = f"messages[{i}].content[{j}]"
                if m.get("role") not in ("user", "system", "developer"):
                    raise ImageInputError(f"{where}: images are accepted in user messages only", param=where)
                images.append(decode_image(part_source(part, where), allow_remote=allow_remote,
                                           max_pixels=max_pixels, where=where))
                parts.append({"type": "image"})
            elif isinstance(part, dict) and part.get("type") == "text":
                parts.append({"type": "text", "text": part.get("text") or ""})
            elif isinstance(part, str):
                parts.append({"type": "text", "text": part})
            else:
                ptype = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ImageInputError(f"messages[{i}].content[{j}]: content part of type {ptype!r} is not supported",
                                      param=f"messages[{i}].content[{j}]")
        out.append({**m, "content": parts})
    return out, images
