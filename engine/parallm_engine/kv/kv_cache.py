"""The prefix a decode batch holds once, and the column layout of a batched prefill.

A prefix that several rows continue (the agent fan-out's system prompt and tools) can be held once
for the whole batch (:class:`SharedPrefix`): those rows store only the tokens after it, and attention
reads it once per step for all of them (``cpu_kernels.cascade_attention``) instead of once per row; a
prefill group continuing it reads it the same way (``paged_prefill``).

The running rows' KV, and the prompts' KV from their first prefill forward on, is paged
(``kv_pages``, ``paged_prefill``).
"""

from __future__ import annotations

import mlx.core as mx


class SharedPrefix:
    """A prefix held once for every batch row that continues it: its tokens and, per layer, its
    (1, H, P, D) keys and values. ``release`` is called once when the batch stops using it: it unpins
    the radix node the KV came from (pinned while the batch holds it, so the tree cannot evict and
    recompute it; ``prefix_sharing``).
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


def prefill_layout(prefix_lens: list[int], new_lens: list[int]):
    """RoPE offsets and the (B, 1, L, P + L) boolean mask of a batched prefill: row i's ``prefix_lens[i]``
    tokens already held right-aligned in columns ``[0, P)`` (P = the longest), its ``new_lens[i]`` new
    tokens right-aligned in ``[P, P + L)`` (L = the longest). The holes in between are masked; each
    padding query attends to its own column only, so nothing in the pass is ever a NaN. The offsets make
    row i's first new token sit at position ``prefix_lens[i]``."""
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
