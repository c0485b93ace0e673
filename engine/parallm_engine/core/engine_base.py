"""What every engine (the decoder :class:`~parallm_engine.core.engine.Engine`, the encoder
:class:`~parallm_engine.embed.encoder_engine.EncoderEngine`) answers the same way from its ``model_info`` and
``_dead``: what front ends read about it before they submit."""

from __future__ import annotations


class EngineBase:
    """Mixed into an engine that has ``model_info`` (a ``loader.ModelInfo``) and ``_dead`` (None while it runs)."""

    @property
    def model_name(self) -> str:
        return self.model_info.name

    @property
    def context_window(self) -> int:
        return self.model_info.context_window

    @property
    def is_alive(self) -> bool:
        """Whether the engine accepts requests (False once shut down, or if its thread died)."""
        return self._dead is None
