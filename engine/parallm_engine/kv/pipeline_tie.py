"""What mlx-lm's own pipeline forward asks of a cache.

A stage of mlx-lm's ``model.pipeline(group)`` (qwen2, deepseek, ...) sends its hidden state on and then
ties the send to its last layer's cache, ``cache[-1].keys = mx.depends(cache[-1].keys, h)``, so mlx-lm's
generation (which evaluates only the caches after a prefill chunk) still sends. The engine's forwards
evaluate their outputs, which hold the send already (through the stage's ``all_gather``), so its step caches
only need to take the assignment: ``keys`` here is a stand-in that stores what it is given and is never read
by attention. (The decode lanes' ``PagedLayerKV.keys`` is its pool: the tie leaves the pool's values as they
are.)
"""

from __future__ import annotations

import mlx.core as mx


class PipelineTie:
    _tie: mx.array | None = None

    @property
    def keys(self) -> mx.array:
        if self._tie is None:
            self._tie = mx.zeros((0,))
        return self._tie

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._tie = value
