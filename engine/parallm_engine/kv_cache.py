"""KV storage for the running batch and for a sequence being prefilled.

Both classes follow the cache protocol mlx-lm's models call (``offset``, ``update_and_fetch``,
``make_mask``), so any mlx-lm model with plain full-attention layers runs on them unchanged.

The decode batch is left-padded: every row appends its new token at the same column ``idx``; row i
holds valid keys in columns [left_pad[i], idx). A sequence joins by being copied in right-aligned; it
leaves by having its row dropped, after which common left padding is trimmed.

Rows may end at different positions: a speculative step writes every row's 1 + k verified positions
and each row keeps only the ones it accepted (:meth:`BatchKV.rollback_rows`). A row's unkept columns
become holes: masked for attention (``filled``), not counted in its RoPE position, never copied out. When
holes grow to a quarter of the rows' columns the batch is compacted (one gather per layer).

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

from . import kv_quant as kvq

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

    def segment(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """A private copy of columns [start, end), for the radix tree."""
        return (
            kvq.contiguous(self.keys[..., start:end, :]),
            kvq.contiguous(self.values[..., start:end, :]),
        )

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
    ``tree_owned``: the arrays are the radix node's own (not a concatenation), so holding them costs
    no memory beyond the tree's."""

    def __init__(self, tokens: list[int], kv: list[tuple[mx.array, mx.array]], release=None,
                 tree_owned: bool = False):
        self.tokens = list(tokens)
        self.kv = kv
        self.length = len(self.tokens)
        self._release = release
        self.tree_owned = tree_owned

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


class BatchKV:
    """The running batch's cache for one layer. Shape (B, H, capacity, D), left-padded."""

    mask_5d = False

    def __init__(self, fmt=None, holes: bool = True):
        self.fmt = fmt
        # False: holes are closed as soon as they appear (for model code that takes the cache's largest
        # offset as its column count: mlx-vlm's language models cut their mask there)
        self.holes_allowed = holes
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.idx = 0
        self.left_pad: list[int] = []
        self._lp = mx.array([], dtype=mx.int32)
        self.offset = mx.array([], dtype=mx.int32)
        # A shared prefix (this layer's (1, H, P, D) keys and values, as stored) and which rows continue
        # it. Those rows store only their tokens after it; their positions start at P.
        self._shared_k = None
        self._shared_v = None
        self.shared_len = 0
        self.shared_rows: list[bool] = []
        self.shared_mask: mx.array | None = None  # (B,) bool: row attends to the prefix
        # Holes (columns a row skips, after speculative steps that kept fewer of its positions than of
        # another row's): per row how many, and a (B, C) mask of the columns [0, C) that hold a token
        # (columns from C on all do). None while no row has a hole.
        self.holes: list[int] = []
        self.filled: mx.array | None = None

    @property
    def batch_size(self) -> int:
        return len(self.left_pad)

    @property
    def shared_keys(self) -> mx.array | None:
        """The shared prefix's keys as attention reads them (None: no prefix)."""
        return kvq.as_float(self._shared_k)

    @property
    def shared_values(self) -> mx.array | None:
        return kvq.as_float(self._shared_v)

    def _sync(self) -> None:
        self._lp = mx.array(self.left_pad, dtype=mx.int32)
        self.offset = self.idx - self._lp
        if any(self.holes):
            self.offset = self.offset - mx.array(self.holes, dtype=mx.int32)
        else:
            self.filled = None
        if self._shared_k is not None:
            uses = mx.array(self.shared_rows, dtype=mx.bool_)
            self.offset = self.offset + uses.astype(mx.int32) * self.shared_len
            self.shared_mask = None if all(self.shared_rows) else uses  # None: every row continues it

    def set_shared(self, keys: mx.array | None, values: mx.array | None) -> None:
        """Hold this (1, H, P, D) prefix once for the rows that will continue it (None: no prefix).
        Only while no row uses a shared prefix."""
        assert not any(self.shared_rows), "rows still continue the current shared prefix"
        self._shared_k, self._shared_v = keys, values
        self.shared_len = 0 if keys is None else keys.shape[2]
        self.shared_mask = None
        self._sync()

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        keys, values = kvq.store(keys, self.fmt), kvq.store(values, self.fmt)
        prev = self.idx
        n = keys.shape[2]
        if self.keys is None:  # every row joined with nothing prefilled (one-token prompts)
            B, H, _, D = keys.shape
            self.keys = kvq.zeros((B, H, _round_up(prev + n), D), keys)
            self.values = kvq.zeros((B, H, _round_up(prev + n), values.shape[3]), values)
        elif prev + n > self.keys.shape[2]:
            grow = _round_up(prev + n) - self.keys.shape[2]
            pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
            self.keys = kvq.pad(self.keys, pad)
            self.values = kvq.pad(self.values, pad)
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.idx = prev + n
        self.offset = self.offset + n
        return kvq.as_float(self.keys[..., : self.idx, :]), kvq.as_float(self.values[..., : self.idx, :])

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window layer got a full-attention cache")  # never run it wrong
        if N == 1 and not any(self.left_pad) and self.filled is None:
            return None  # every row sees every column: SDPA's unmasked path is faster
        mask = create_causal_mask(N, offset=self.idx, left_padding=self._lp)
        if self.filled is not None:
            mask = mask & self._filled_columns(self.idx + N)[:, None, None, :]
        return _shape(mask, self.mask_5d)

    def _filled_columns(self, n: int) -> mx.array:
        """The (B, n) mask of columns that hold a token (left padding aside): ``filled`` cut or extended."""
        C = self.filled.shape[1]
        if C >= n:
            return self.filled[:, :n]
        return mx.concatenate([self.filled, mx.ones((self.batch_size, n - C), dtype=mx.bool_)], axis=1)

    def add(self, rows: list[tuple[mx.array, mx.array]], shared: list[bool] | None = None) -> None:
        """Append sequences, each given as its (1, H, L, D) keys and values: the tokens after the
        shared prefix for rows flagged in ``shared``, all of them otherwise.

        The new storage is allocated once and every row (the running ones shifted right when the new
        ones are longer) is written into it with slice updates, which MLX performs in place: one copy
        of each row, where padding and concatenating row by row made three."""
        shared = shared or [False] * len(rows)
        if any(shared) and self._shared_k is None:
            raise ValueError("rows continue a shared prefix but none is set")
        lengths = [0 if k is None else k.shape[2] for k, _ in rows]
        new_idx = max([self.idx] + lengths)
        cap = _round_up(new_idx + 1)
        old = self.batch_size
        ref = next(((k, v) for k, v in rows if k is not None), None)
        if ref is None and self.keys is None:
            # Nothing stored yet (one-token prompts): the first update allocates, rows start at idx.
            self.left_pad += [new_idx] * len(rows)
            self.shared_rows += list(shared)
            self.holes += [0] * len(rows)
            self.idx = new_idx
            self._sync()
            return
        ref_k, ref_v = ref if ref is not None else (self.keys, self.values)
        H, Dk, Dv = ref_k.shape[1], ref_k.shape[3], ref_v.shape[3]
        keys = kvq.zeros((old + len(rows), H, cap, Dk), ref_k)
        values = kvq.zeros((old + len(rows), H, cap, Dv), ref_v)
        if old:
            shift = new_idx - self.idx
            if self.keys is not None:
                keys[:old, :, shift:new_idx, :] = self.keys[..., : self.idx, :]
                values[:old, :, shift:new_idx, :] = self.values[..., : self.idx, :]
            self.left_pad = [lp + shift for lp in self.left_pad]
            if self.filled is not None:  # holes move right with their rows; new rows have none
                parts = [mx.ones((old, shift), dtype=mx.bool_), self.filled] if shift else [self.filled]
                filled = mx.concatenate(parts, axis=1)
                self.filled = mx.concatenate([filled, mx.ones((len(rows), filled.shape[1]), dtype=mx.bool_)])
        self.holes += [0] * len(rows)
        for r, ((k, v), L) in enumerate(zip(rows, lengths)):
            if L:
                keys[old + r : old + r + 1, :, new_idx - L : new_idx, :] = k
                values[old + r : old + r + 1, :, new_idx - L : new_idx, :] = v
            self.left_pad.append(new_idx - L)
        self.shared_rows += list(shared)
        self.keys, self.values = keys, values
        self.idx = new_idx
        self._sync()

    def share_rows(self, indices: list[int]) -> None:
        """Rows ``indices``, which hold their whole context and whose first ``shared_len`` tokens are
        bitwise the shared prefix, drop those columns and read the shared prefix instead. The storage is
        rebuilt once as long as the longest remaining row (a row that joined before the prefix was set
        no longer makes every row as long as itself)."""
        self.compact()
        P = self.shared_len
        assert P and self.keys is not None and not any(self.shared_rows[i] for i in indices)
        share = set(indices)
        lengths = [self.idx - lp - (P if i in share else 0) for i, lp in enumerate(self.left_pad)]
        assert min(lengths) >= 0, "a row is shorter than the prefix it would share"
        new_idx = max(lengths)
        B, H, _, Dk = self.keys.shape
        keys = kvq.zeros((B, H, _round_up(new_idx + 1), Dk), self.keys)
        values = kvq.zeros((B, H, keys.shape[2], self.values.shape[3]), self.values)
        for i, L in enumerate(lengths):
            if L:
                keys[i : i + 1, :, new_idx - L : new_idx, :] = self.keys[i : i + 1, :, self.idx - L : self.idx, :]
                values[i : i + 1, :, new_idx - L : new_idx, :] = self.values[i : i + 1, :, self.idx - L : self.idx, :]
        self.keys, self.values = keys, values
        self.left_pad = [new_idx - L for L in lengths]
        self.shared_rows = [u or i in share for i, u in enumerate(self.shared_rows)]
        self.idx = new_idx
        self._sync()

    def keep(self, indices: list[int]) -> None:
        """Keep only these rows (in this order), then trim padding every row shares."""
        if not indices:
            self.keys = self.values = None
            self.idx = 0
            self.left_pad = []
            self.shared_rows = []
            self.holes = []
            self._sync()
            return
        sel = mx.array(indices)
        if self.keys is not None:
            self.keys = self.keys[sel]
            self.values = self.values[sel]
        self.left_pad = [self.left_pad[i] for i in indices]
        self.shared_rows = [self.shared_rows[i] for i in indices]
        self.holes = [self.holes[i] for i in indices]
        if self.filled is not None:
            self.filled = self.filled[sel]
        trim = min(self.left_pad) if self.keys is not None else 0
        if trim:
            self.keys = self.keys[..., trim:, :]
            self.values = self.values[..., trim:, :]
            self.idx -= trim
            self.left_pad = [lp - trim for lp in self.left_pad]
            if self.filled is not None:
                self.filled = self.filled[:, trim:]
        self._sync()

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` columns of every row (speculative verification wrote positions that were
        rejected, or that are recomputed next step): nothing reads them again, the next write reuses them."""
        if n:
            self.idx -= n
            if self.filled is not None and self.filled.shape[1] > self.idx:
                self.filled = self.filled[:, : self.idx]
            self._sync()

    def rollback_rows(self, width: int, keeps: list[int]) -> None:
        """After a forward that wrote ``width`` columns per row, row i keeps the first ``keeps[i]`` of
        them. The batch's end moves back to the row that keeps most; every other row's unkept columns
        become holes (masked, not counted in its position), so no row gives up what it accepted."""
        top = max(keeps)
        base = self.idx - width
        self.rollback(width - top)
        gaps = [top - k for k in keeps]
        if not any(gaps):
            return
        starts = mx.array([base + k for k in keeps], dtype=mx.int32)[:, None]
        kept = mx.arange(self.idx)[None, :] < starts  # columns from a row's start on are its new holes
        self.filled = kept if self.filled is None else self._filled_columns(self.idx) & kept
        self.holes = [h + g for h, g in zip(self.holes, gaps)]
        self._sync()
        if not self.holes_allowed or 4 * sum(self.holes) > sum(self.idx - lp for lp in self.left_pad):
            self.compact()

    def _own_columns(self, i: int, filled: list[bool] | None = None) -> list[int]:
        """Row i's columns that hold its tokens after the shared prefix, in order (``filled``: the row's
        ``_filled_columns`` already on the host)."""
        lp = self.left_pad[i]
        if not self.holes[i]:
            return list(range(lp, self.idx))
        if filled is None:
            filled = self._filled_columns(self.idx)[i].tolist()
        return [c for c in range(lp, self.idx) if filled[c]]

    def compact(self) -> None:
        """Close every row's holes: each row's tokens are gathered right-aligned (one gather per array)."""
        if not any(self.holes):
            return
        filled = self._filled_columns(self.idx).tolist()  # one transfer for every row
        cols = [self._own_columns(i, filled[i]) for i in range(self.batch_size)]
        new_idx = max(len(c) for c in cols)
        index = [[0] * (new_idx - len(c)) + c for c in cols]
        index, cap = mx.array(index, dtype=mx.int32), _round_up(new_idx + 1)
        self.keys = kvq.take_columns(self.keys, index, cap)
        self.values = kvq.take_columns(self.values, index, cap)
        self.left_pad = [new_idx - len(c) for c in cols]
        self.holes = [0] * self.batch_size
        self.idx = new_idx
        self._sync()

    def row(self, i: int, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Row i's tokens [start, end) (counted from the sequence's first token, the shared prefix
        included when the row continues it) as private (1, H, end - start, D) copies."""
        P = self.shared_len if self.shared_rows[i] else 0
        lp = self.left_pad[i]
        ks, vs = [], []
        if start < P:
            ks.append(self._shared_k[..., start : min(end, P), :])
            vs.append(self._shared_v[..., start : min(end, P), :])
        if end > P and self.holes[i]:
            cols = mx.array(self._own_columns(i)[max(start, P) - P : end - P], dtype=mx.int32)
            ks.append(self.keys[i : i + 1, :, cols, :])
            vs.append(self.values[i : i + 1, :, cols, :])
        elif end > P:
            a, b = lp + max(start, P) - P, lp + end - P
            ks.append(self.keys[i : i + 1, :, a:b, :])
            vs.append(self.values[i : i + 1, :, a:b, :])
        cat = lambda parts: parts[0] if len(parts) == 1 else kvq.concatenate(parts, axis=2)
        return kvq.contiguous(cat(ks)), kvq.contiguous(cat(vs))

    def nbytes(self) -> int:
        """Bytes of the rows' own storage (a shared prefix is counted by its owner, once)."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class FrozenKV:
    """A finished sequence's KV for one layer, as a view of row ``i`` of a batched prefill's
    (B, H, P + L, D) block: tokens [0, p) sit in columns [P - p, P), tokens [p, p + n) in
    [P + L - n, P + L). When every row continued one shared prefix (``prefix``: its (1, H, P, D) keys
    and values, p == P) the block holds only the L chunk columns and tokens [0, P) come from the prefix.
    What the prefill hands on to the radix tree (:meth:`segment`: private copies of just the asked-for
    tokens) and the decode batch (:meth:`valid` / :meth:`tail`: lazy, copied once when the batch takes
    them). Nothing is copied when the view is made."""

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

    def segment(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        return kvq.contiguous(self._take(0, start, end)), kvq.contiguous(self._take(1, start, end))


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
