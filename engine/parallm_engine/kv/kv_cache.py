"""KV storage for sequences being prefilled, and the prefix a decode batch holds once.

The caches follow the protocol mlx-lm's models call (``offset``, ``update_and_fetch``, ``make_mask``), so
any mlx-lm model with plain full-attention layers runs on them unchanged. The running rows' KV is paged
(``kv_pages``).

A prefix that several rows continue (the agent fan-out's system prompt and tools) can be held once
for the whole batch (:class:`SharedPrefix`): those rows store only the tokens after it, and attention
reads it once per step for all of them (``cpu_kernels.cascade_attention``) instead of once per row.

With KV quantization on (``fmt``: a ``kv_quant.KVFormat``) every cache stores its KV quantized
(``kv_quant.QuantizedKV``, which the operations below accept in place of arrays) and hands attention the
dequantized values.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from parallm_engine.kv import kv_quant as kvq

STEP = 256  # the largest capacity step (mlx-lm grows every cache by 256)
MIN_STEP = 32


def _round_up(n: int) -> int:
    """Capacity for ``n`` columns: the step grows with the length (32 up to 256 columns, then an
    eighth of the length, at most 256), so appends reallocate rarely while a batch of short rows, e.g.
    a fan-out's own tokens after a shared prefix, does not hold 256 columns per row."""
    step = min(STEP, max(MIN_STEP, 1 << max(0, n.bit_length() - 3)))
    return ((n + step - 1) // step) * step


def _shape(mask, five_d: bool):
    """A (B, 1, L, S) mask as (B, 1, 1, L, S) for models whose attention scores are laid out
    (B, KV heads, repeats, L, S) (gemma2); unchanged otherwise."""
    if five_d and isinstance(mask, mx.array) and mask.ndim == 4:
        return mask[:, :, None]
    return mask


class SequenceKV:
    """One sequence's cache for one layer, used during (chunked) prefill. Shape (1, H, T, D)."""

    mask_5d = False

    def __init__(self, keys: mx.array | None = None, values: mx.array | None = None, fmt=None):
        self.fmt = fmt
        self.keys = None
        self.values = None
        self.offset = 0
        if keys is not None and keys.shape[2] > 0:
            n = keys.shape[2]
            cap = _round_up(n + 1)
            pad = [(0, 0), (0, 0), (0, cap - n), (0, 0)]
            self.keys = kvq.pad(keys, pad)
            self.values = kvq.pad(values, pad)
            self.offset = n

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        keys, values = kvq.store(keys, self.fmt), kvq.store(values, self.fmt)
        prev = self.offset
        n = keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            cap = _round_up(prev + n)
            B, H, _, D = keys.shape
            new_k = kvq.zeros((B, H, cap, D), keys)
            new_v = kvq.zeros((B, H, cap, values.shape[3]), values)
            if self.keys is not None:
                new_k[..., :prev, :] = self.keys[..., :prev, :]
                new_v[..., :prev, :] = self.values[..., :prev, :]
            self.keys, self.values = new_k, new_v
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset = prev + n
        return kvq.as_float(self.keys[..., : self.offset, :]), kvq.as_float(self.values[..., : self.offset, :])

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window layer got a full-attention cache")  # never run it wrong
        if N == 1:
            return None
        if self.offset == 0 and not return_array and not self.mask_5d:
            return "causal"
        return _shape(create_causal_mask(N, offset=self.offset), self.mask_5d)

    def valid(self) -> tuple[mx.array | None, mx.array | None]:
        if self.keys is None:
            return None, None  # a one-token prompt: nothing prefilled
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def tail(self, start: int) -> tuple[mx.array | None, mx.array | None]:
        """Tokens [start, offset) (what a row continuing a shared prefix of ``start`` tokens keeps)."""
        if self.keys is None:
            return None, None
        return self.keys[..., start : self.offset, :], self.values[..., start : self.offset, :]


class SharedPrefix:
    """A prefix held once for every batch row that continues it: its tokens and, per layer, its
    (1, H, P, D) keys and values. ``release`` is called once when the batch stops using it (the
    scheduler unpins the radix node the KV came from, so the tree cannot evict and recompute it).
    ``tree_node``: the radix node whose own arrays these are (not a concatenation), so holding them
    costs no memory beyond the tree's, as long as the node still holds them (a split gives the node
    copies of its halves: from then on the batch's arrays are its own)."""

    def __init__(self, tokens: list[int], kv: list[tuple[mx.array, mx.array]], release=None, tree_node=None):
        self.tokens = list(tokens)
        self.kv = kv
        self.length = len(self.tokens)
        self._release = release
        self.tree_node = tree_node

    @property
    def tree_owned(self) -> bool:
        node = self.tree_node
        if node is None or not isinstance(node.kv, list) or not node.kv:
            return False
        return node.kv[0][0] is self.kv[0][0]

    def continues(self, prompt_ids: list[int]) -> bool:
        return len(prompt_ids) > self.length and prompt_ids[: self.length] == self.tokens

    def release(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)

    def held_nbytes(self) -> int:
        """Bytes this object alone keeps alive (0 when they are the radix tree's)."""
        return 0 if self.tree_owned else self.nbytes()


class FrozenKV:
    """A finished sequence's KV for one layer, as a view of row ``i`` of a batched prefill's
    (B, H, P + L, D) block: tokens [0, p) sit in columns [P - p, P), tokens [p, p + n) in
    [P + L - n, P + L). When every row continued one shared prefix (``prefix``: its (1, H, P, D) keys
    and values, p == P) the block holds only the L chunk columns and tokens [0, P) come from the prefix.
    What the prefill hands on to the decode batch (:meth:`valid` / :meth:`tail`: lazy, copied once into
    the row's pages when the batch takes them; the radix tree then holds those pages). Nothing is copied
    when the view is made."""

    def __init__(self, keys: mx.array, values: mx.array, i: int, p: int, n: int, P: int, L: int, prefix=None):
        self._arrays = (keys, values)
        self._i, self._p, self._n, self._P, self._L = i, p, n, P, L
        self._prefix = prefix
        self.offset = p + n

    def _take(self, which: int, start: int, end: int) -> mx.array:
        """Tokens [start, end) of the keys (which=0) or values (1)."""
        p, n, P, L, i = self._p, self._n, self._P, self._L, self._i
        block = self._arrays[which]
        parts = []
        if start < p:
            if self._prefix is not None:
                parts.append(self._prefix[which][..., start : min(end, p), :])
            else:
                parts.append(block[i : i + 1, :, P - p + start : P - p + min(end, p), :])
        if end > p:
            first = (0 if self._prefix is not None else P) + L - n  # column of token p
            a = max(start, p) - p
            parts.append(block[i : i + 1, :, first + a : first + end - p, :])
        return parts[0] if len(parts) == 1 else kvq.concatenate(parts, axis=2)

    def valid(self) -> tuple[mx.array, mx.array]:
        return self._take(0, 0, self.offset), self._take(1, 0, self.offset)

    def tail(self, start: int) -> tuple[mx.array, mx.array]:
        return self._take(0, start, self.offset), self._take(1, start, self.offset)


class PrefillBatchKV:
    """One layer's cache for prefilling several sequences in one forward pass.

    Row i has ``p_i`` cached prefix tokens (from the radix tree) and ``n_i`` new tokens. Columns:
    ``[0, P)`` hold prefixes right-aligned (P = max p_i), ``[P, P + L)`` the chunk of new tokens,
    right-aligned too (L = max n_i). The holes in between are masked; each padding query attends to
    itself only, so nothing in the pass is ever a NaN. RoPE offsets make row i's first new token sit
    at logical position p_i.

    With ``shared=True`` every row continues the same prefix, given once as (1, H, P, D): it is not
    copied into the rows; the attention hook reads it through ``shared_keys`` / ``shared_values``
    (``cpu_kernels.cascade_attention``) and the mask covers only the chunk's columns.
    """

    mask_5d = False  # the scheduler shapes this cache's mask itself

    def __init__(self, prefix_keys: mx.array | None, prefix_values: mx.array | None, offset: mx.array,
                 mask: mx.array, shared: bool = False, fmt=None):
        self.fmt = fmt
        self.prefix_keys, self.prefix_values = prefix_keys, prefix_values
        self.offset = offset
        self._mask = mask
        self.keys = self.values = None
        self.shared = shared
        self.shared_mask = None
        if shared:
            self._mask = mask[..., prefix_keys.shape[2]:]

    @property
    def shared_keys(self) -> mx.array | None:
        """The prefix every row continues, as attention reads it (None: rows hold their own)."""
        return kvq.as_float(self.prefix_keys) if self.shared else None

    @property
    def shared_values(self) -> mx.array | None:
        return kvq.as_float(self.prefix_values) if self.shared else None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        keys, values = kvq.store(keys, self.fmt), kvq.store(values, self.fmt)
        if self.prefix_keys is not None and not self.shared:
            keys = kvq.concatenate([self.prefix_keys, keys], axis=2)
            values = kvq.concatenate([self.prefix_values, values], axis=2)
        self.keys, self.values = keys, values
        return kvq.as_float(keys), kvq.as_float(values)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window layer got a full-attention cache")  # never run it wrong
        return self._mask

    def row(self, i: int, p: int, n: int, P: int, L: int) -> FrozenKV:
        prefix = (self.prefix_keys, self.prefix_values) if self.shared else None
        return FrozenKV(self.keys, self.values, i, p, n, P, L, prefix)


def prefill_layout(prefix_lens: list[int], new_lens: list[int]):
    """RoPE offsets and the (B, 1, L, P + L) boolean mask for a PrefillBatchKV group."""
    P, L = max(prefix_lens), max(new_lens)
    p = mx.array(prefix_lens)[:, None, None]
    n = mx.array(new_lens)[:, None, None]
    q = mx.arange(L)[None, :, None]  # query index within the chunk
    c = mx.arange(P + L)[None, None, :]  # key column
    real_q = q >= (L - n)
    in_prefix = (c >= P - p) & (c < P)
    in_chunk = (c >= P + L - n) & (c <= P + q)
    mask = (real_q & (in_prefix | in_chunk)) | (c == P + q)
    offset = mx.array([pl - (L - nl) for pl, nl in zip(prefix_lens, new_lens)])
    return offset, mask[:, None, :, :], P, L
