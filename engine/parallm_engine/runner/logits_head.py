"""The model split into its hidden-state forward and its LM head, where that split is exact.

A step that runs a prompt's chunk in the decode forward (``kv.fused_step``) needs logits for the decode
rows only: computing them for the chunk's positions too would add a (positions x vocabulary) matmul that
nothing reads (a quarter of the chunk's own work on a 135M model with a 49k vocabulary). mlx-lm's
``Model.__call__`` is ``head(self.model(inputs, cache))`` for most families, the head being ``lm_head``
or the tied embedding's ``as_linear``; some scale around it (granite divides the logits by
``logits_scaling``, cohere multiplies them by ``logit_scale``, minicpm divides the hidden state by
``hidden_size / dim_model_base`` before the head) or add a soft cap. Rather than trust a list of families,
:func:`split_head` checks each candidate split once, at load, against the model's own forward on two tokens
(bitwise) and keeps the first that matches; a family whose output none matches gets None, and its steps are
not fused.
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
    heads = _candidates(model, inner)
    if not heads:
        return None
    try:
        probe = mx.array([[1, 2]], dtype=mx.int32)
        whole, hidden = model(probe), inner(probe)
        for head in heads:
            split = head(hidden)
            mx.eval(whole, split)
            if whole.shape == split.shape and whole.dtype == split.dtype and bool(mx.array_equal(whole, split)):
                return inner, head
    except Exception as e:  # a family whose forward wants more than token ids: no split
        logger.debug("no hidden-state / head split for %s: %s", type(model).__module__, e)
    return None


def _candidates(model, inner) -> list:
    """The heads to check, plain first, then the scalings mlx-lm's families apply around it."""
    if callable(getattr(model, "lm_head", None)):
        def head(h):  # looked up per call: a LoRA adapter on the head wraps it later (runner.lora)
            return model.lm_head(h)
    else:
        embed = getattr(inner, "embed_tokens", None)
        if embed is None or not hasattr(embed, "as_linear"):
            return []
        head = embed.as_linear
    heads = [head]
    scaling = getattr(model, "logits_scaling", None)  # granite: logits / logits_scaling
    if isinstance(scaling, (int, float)):
        heads.append(lambda h: head(h) / scaling)
    scale = getattr(getattr(inner, "args", None), "logit_scale", None)  # cohere: logits * logit_scale
    if isinstance(scale, (int, float)):
        heads.append(lambda h: head(h) * scale)
    args = getattr(model, "args", None)  # minicpm: the hidden state scaled before the head
    base = getattr(args, "dim_model_base", None)
    if isinstance(base, (int, float)) and base and isinstance(getattr(args, "hidden_size", None), int):
        heads.append(lambda h: head(h / (args.hidden_size / base)))
    return heads
