"""Bytes written into KV storage, counted where they are written (the engine's KV cache manager holds one).

``written``: KV of tokens stored into the page pools, once per (token, layer) computed or copied into a
row's pages (a decode step's column that the kept working set takes counts then: the pool's copy follows at
its flush, ``decode_working_set``). ``decoded``: positions the decode forwards computed (each writes its KV once), so that
``written == bytes_per_token x (prefill tokens + decoded)`` when nothing is copied. ``moved``: bytes the
pools relocate without new content (a pool array grown by a copy, a shrink renumbering pages, a prefix
the decode batch holds once moved out of pages into arrays). The test suite asserts that a prompt's KV
is written exactly once between its prefill and its decode (tests/test_kv_writes.py); ``Engine.stats()``
reports the three under ``"memory"``.
"""

from __future__ import annotations

import mlx.core as mx

from parallm_engine.kv import kv_quant as kvq


def nbytes(*xs) -> int:
    """Bytes of stored KV (float arrays or ``kv_quant.QuantizedKV``). Every layer of every step counts its
    writes here: a float array is counted without the walk over a quantized one's parts."""
    total = 0
    for x in xs:
        if isinstance(x, mx.array):
            total += x.nbytes
        elif x is not None:
            total += sum(a.nbytes for a in kvq.arrays(x))
    return total


class KVWriteMeter:
    __slots__ = ("written", "moved", "decoded")

    def __init__(self):
        self.written = 0
        self.moved = 0
        self.decoded = 0

    def wrote(self, *xs) -> None:
        self.written += nbytes(*xs)

    def as_dict(self) -> dict:
        return {"kv_bytes_written": self.written, "kv_bytes_moved": self.moved, "kv_positions_decoded": self.decoded}
