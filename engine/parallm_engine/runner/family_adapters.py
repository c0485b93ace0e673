"""What a model family needs from the engine beyond mlx-lm's own forward: one small adapter per family.

The model runner (``model_runner``) and the KV cache manager (``kv_cache_manager``) ask the adapter;
nothing else branches on a model type. Families with nothing special get the default adapter.

- MLA (DeepSeek-style ``kv_lora_rank`` models) attends over keys decompressed from its cached latents
  and passes positional scores in its mask: it keeps whole rows (no shared prefix read once, no ragged
  step reading the page pool, whose rectangle mask would replace those scores).
- gemma2 lays its attention scores out (B, KV heads, repeats, L, S): its masks need one more axis, in
  a prefill step (``paged_prefill``, the mixed layout's mlx-lm caches) and the decode batch alike.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyAdapter:
    model_type: str = ""
    mla: bool = False
    mask_5d: bool = False

    def reads_pool(self, hooked: bool) -> bool:
        """Whether the model's attention reads the rows' pages itself (the engine's attention hook is
        installed and the family attends over the cached keys as they are)."""
        return hooked and not self.mla

    def prefill_caches(self, caches: list) -> list:
        """A sequence's own prefill caches, shaped for this family's masks."""
        if self.mask_5d:
            for c in caches:
                c.mask_5d = True
        return caches

    def prepare_batch(self, batch, layout: str) -> None:
        """The decode batch's masks for this family (attention layout: the engine's own batch)."""
        if self.mask_5d and layout == "attention":
            batch.set_mask_5d()


def adapter_for(model_info) -> FamilyAdapter:
    config = getattr(model_info, "config", None) or {}
    model_type = str(config.get("model_type", ""))
    return FamilyAdapter(model_type=model_type, mla=bool(config.get("kv_lora_rank")),
                         mask_5d=model_type == "gemma2")
