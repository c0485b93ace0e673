"""What a model family needs from the engine beyond mlx-lm's own forward: one small adapter per family.

The model runner (``model_runner``) and the KV cache manager (``kv_cache_manager``) ask the adapter;
nothing else branches on a model type. Families with nothing special get the default adapter.

- MLA (DeepSeek-style ``kv_lora_rank`` models) attends over keys decompressed from its cached latents
  and passes positional scores in its mask: it keeps whole rows (no shared prefix read once, no ragged
  step reading the page pool, whose rectangle mask would replace those scores).
- gemma2 lays its attention scores out (B, KV heads, repeats, L, S) where heads repeat: the (B, 1, L, S)
  masks every engine cache makes need one more axis there. Its adapter switches the model's own attention
  modules to a subclass that adds it (:meth:`Gemma2Adapter.install`), so no cache, batch or kernel knows.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class FamilyAdapter:
    model_type: str = ""
    mla: bool = False

    def install(self, model) -> None:
        """Switch ``model``'s own module instances to what this family needs (nothing by default)."""

    def reads_pool(self, hooked: bool) -> bool:
        """Whether the model's attention reads the rows' pages itself (the engine's attention hook is
        installed and the family attends over the cached keys as they are)."""
        return hooked and not self.mla


@dataclass(frozen=True)
class Gemma2Adapter(FamilyAdapter):
    def install(self, model) -> None:
        """Each attention module whose heads repeat takes (B, 1, L, S) masks as (B, 1, 1, L, S). Only this
        model's instances are switched (as ``cpu_kernels.install`` does): mlx-lm's class is untouched."""
        if not isinstance(model, nn.Module):
            return
        for _, module in model.named_modules():
            if getattr(module, "repeats", 1) > 1 and hasattr(module, "attn_logit_softcapping") \
                    and not getattr(type(module), "_parallm_mask_axis", False):
                module.__class__ = _mask_axis_class(type(module))


_mask_axis_classes: dict[type, type] = {}


def _mask_axis_class(cls: type) -> type:
    if cls not in _mask_axis_classes:
        def __call__(self, x, mask=None, cache=None):
            if isinstance(mask, mx.array) and mask.ndim == 4:  # scores are (B, KV heads, repeats, L, S)
                mask = mask[:, :, None]
            return cls.__call__(self, x, mask, cache)

        sub = type(cls.__name__, (cls,), {"__call__": __call__, "_parallm_mask_axis": True})
        sub.__module__ = cls.__module__
        _mask_axis_classes[cls] = sub
    return _mask_axis_classes[cls]


def adapter_for(model_info) -> FamilyAdapter:
    config = getattr(model_info, "config", None) or {}
    model_type = str(config.get("model_type", ""))
    if model_type == "gemma2":
        return Gemma2Adapter(model_type=model_type)
    return FamilyAdapter(model_type=model_type, mla=bool(config.get("kv_lora_rank")))
