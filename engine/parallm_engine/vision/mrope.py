"""M-RoPE (Qwen2-VL / Qwen2.5-VL / Qwen3-VL, dense and MoE): per-sequence 3-D positions, so image
requests batch with anything; and Qwen3-VL's DeepStack inputs.

These language models rotate queries and keys by three position streams (time, height, width). A text
token's three positions are equal; an image's tokens take theirs from the image grid, and every token
after the image continues at (largest position so far) + 1, i.e. at its 1-D index + a per-sequence
``rope delta`` (negative: an image of h x w tokens advances the positions by max(h, w), not h * w).
mlx-vlm computes them with ``LanguageModel.get_rope_index`` and keeps the delta on the model object
(``_rope_deltas``): one for the whole batch. The engine never lets the model derive positions: every
forward of such a model gets ``position_ids`` (3, B, L) explicitly, built per row from the sequence:

- at prompt build (:func:`prompt_positions`, the caller's thread): mlx-vlm's own ``get_rope_index`` on
  the prompt's ids and its images' grids gives the prompt's (3, L) positions and its delta, stored on
  the :class:`~parallm_engine.vision.vlm.VisionPrompt`;
- prefill (:func:`prefill_positions`): each row's slice ``[start, start + n)`` of its context's
  positions (a chunk resumed mid-prompt, or after a radix-cache hit, takes exactly its columns), left
  padding included (padded columns are masked: any value does);
- decode and speculative verification (:func:`decode_positions`, through the decode batch's
  ``decode_kwargs`` hook): a row's W positions start at the tokens its KV holds (``Sequence.computed``)
  plus its own delta; text-only rows have delta 0.

A prefix's positions depend only on its own tokens and images (the radix key), so reusing its KV for
another prompt is exact.

Qwen3-VL (DeepStack) also adds the vision tower's intermediate features to the hidden states of its first
layers at image positions: the feature cache keeps them beside each image's features, and the prefill
passes the chunk's image rows of them (:func:`deepstack_inputs`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

#: Vision families whose language model uses M-RoPE positions (run with images through this module).
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def image_grid(inputs: dict) -> np.ndarray:
    """One image's (t, h, w) patch grid from the processor's outputs for it alone."""
    return np.array(inputs["image_grid_thw"]).reshape(-1, 3)[0].astype(np.int64)


def prompt_positions(vlm, token_ids: list[int], grids: list[np.ndarray]) -> tuple[np.ndarray, int]:
    """The prompt's (3, L) positions and its rope delta, by mlx-vlm's own ``get_rope_index``."""
    ids = mx.array([token_ids])
    thw = mx.array(np.stack(grids)) if grids else None
    pos, delta = vlm.language_model.get_rope_index(ids, thw, None, None)
    pos = np.array(pos).reshape(-1, len(token_ids))
    if pos.shape[0] == 1:  # no image: mlx-vlm gives the 1-D positions
        pos = np.repeat(pos, 3, axis=0)
    return pos.astype(np.int64), int(np.array(delta).reshape(-1)[0])


def _context_positions(seq, start: int, n: int) -> np.ndarray:
    """(3, n) positions of the sequence's context tokens ``[start, start + n)``: the prompt's computed
    positions, then (its outputs, and text requests throughout) the 1-D index + the rope delta."""
    vp = seq.request.vision
    idx = np.arange(start, start + n, dtype=np.int64)
    if vp is None or vp.mrope is None:
        return np.broadcast_to(idx, (3, n))
    out = np.broadcast_to(idx + vp.rope_delta, (3, n)).copy()
    head = max(0, min(start + n, vp.mrope.shape[1]) - start)
    out[:, :head] = vp.mrope[:, start: start + head]
    return out


def prefill_positions(rows: list[tuple], L: int) -> mx.array:
    """(3, B, L) position ids of a left-padded prefill batch; ``rows``: ``(sequence, start, n)`` each."""
    pos = np.zeros((3, len(rows), L), dtype=np.int32)
    for r, (seq, start, n) in enumerate(rows):
        pos[:, r, L - n:] = _context_positions(seq, start, n)
    return mx.array(pos)


def decode_positions(seqs: list, width: int) -> mx.array:
    """(3, B, W) position ids of a decode (W = 1) or verification forward: row i's W tokens continue its
    KV (``consumed`` tokens) at consecutive positions."""
    starts = np.fromiter((s.computed for s in seqs), np.int64, len(seqs))
    deltas = np.fromiter((_delta(s) for s in seqs), np.int64, len(seqs))
    pos = np.repeat((starts + deltas)[None, :, None] + np.arange(width), 3, axis=0).astype(np.int32)
    # After its prefill a row's KV holds all but its last prompt token (text: at index + delta, as every
    # later token); a row still inside its prompt's image positions takes them from the prompt.
    for r, s in enumerate(seqs):
        vp = s.request.vision
        if vp is not None and vp.mrope is not None and s.computed < vp.mrope.shape[1] - 1:
            pos[:, r] = _context_positions(s, s.computed, width)
    return mx.array(pos)


def _delta(seq) -> int:
    vp = seq.request.vision
    return vp.rope_delta if vp is not None else 0


def deepstack_inputs(picked: mx.array, hidden: int, r_idx: list[int], c_idx: list[int], B: int, L: int) -> dict:
    """Qwen3-VL's DeepStack arguments of a prefill forward. The feature cache keeps an image's rows as
    [features | DeepStack layer 0 | layer 1 ...] side by side (one array per image, so the cache and the
    concatenation of a prompt's images need nothing new); ``picked`` holds the batch's image rows in row-major
    order, which is the order mlx-vlm's ``_deepstack_process`` reads them in."""
    mask = np.zeros((B, L), dtype=bool)
    mask[r_idx, c_idx] = True
    layers = picked.shape[-1] // hidden - 1
    return {"visual_pos_masks": mx.array(mask),
            "deepstack_visual_embeds": [picked[:, hidden * (j + 1): hidden * (j + 2)] for j in range(layers)]}
