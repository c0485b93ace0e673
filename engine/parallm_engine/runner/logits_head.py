"""The model split into its hidden-state forward and its LM head, where that split is exact.

A step that runs a prompt's chunk in the decode forward (``kv.fused_step``) needs logits for the decode
rows only: computing them for the chunk's positions too would add a (positions x vocabulary) matmul that
nothing reads (a quarter of the chunk's own work on a 135M model with a 49k vocabulary). mlx-lm's
``Model.__call__`` is ``head(self.model(inputs, cache))`` for most families, the head being ``lm_head``
or the tied embedding's ``as_linear``; some add a soft cap or a logit scale after it. Rather than trust a
list of families, :func:`split_head` checks the candidate split once, at load, against the model's own
forward on two tokens (bitwise); a family whose output differs gets None, and its steps are not fused.
"""

from __future__ import annotations

import logging

import mlx.core as mx

logger = logging.getLogger(__name__)


def split_head(model):
    """``(backbone, head)`` with ``model(x, cache) == head(backbone(x, cache=cache))`` for every input,
    checked on a probe, or None."""
    inner = getattr(model, "model", None)
    if inner is None or not callable(inner) or getattr(model, "vision", None) is not None:
        return None
    head = _candidate(model, inner)
    if head is None:
        return None
    try:
        probe = mx.array([[1, 2]], dtype=mx.int32)
        whole, split = model(probe), head(inner(probe))
        mx.eval(whole, split)
        same = whole.shape == split.shape and whole.dtype == split.dtype and bool(mx.array_equal(whole, split))
    except Exception as e:  # a family whose forward wants more than token ids: no split
        logger.debug("no hidden-state / head split for %s: %s", type(model).__module__, e)
        return None
    return (inner, head) if same else None


def _candidate(model, inner):
    lm_head = getattr(model, "lm_head", None)
    if callable(lm_head):
        return lm_head
    embed = getattr(inner, "embed_tokens", None)
    if embed is not None and hasattr(embed, "as_linear"):
        return embed.as_linear
    return None
