"""Which decode rows hold a shared prefix once (see ``kv_cache.SharedPrefix``).

When agents fan out over one system prompt and tool schema, every row of the decode batch would hold
its own copy of that prefix's KV and attention would read it once per row per step. The batch holds
one prefix instead, chosen here when sequences join: the longest prefix that two or more of the joining
sequences continue, at least ``MIN_SHARED_PREFIX`` tokens. Later sequences continuing all of it share
it too; the others join with their whole KV.

Only tokens whose KV is bitwise the radix tree's copy count (``Sequence.tree_tokens``), so a row that
reads the shared copy instead of its own computes exactly the same numbers; the prefix's radix node
stays pinned while the batch holds it, so it cannot be evicted and recomputed differently for rows
that join later.
"""

from __future__ import annotations

import mlx.core as mx

from parallm_engine.kv.radix_cache import common_prefix_len
from parallm_engine.kv import kv_quant as kvq
from parallm_engine.kv.kv_cache import SharedPrefix

# Shorter prefixes are not worth the extra matmuls of the two-part (cascade) attention.
MIN_SHARED_PREFIX = 64


def shared_prefix_flags(batch, radix, seqs: list) -> list[bool] | None:
    """For each joining sequence, whether it continues ``batch``'s shared prefix, choosing and setting
    one first if the batch holds none (None: no sequence shares one)."""
    if batch.shared is None:
        cands = [s for s in seqs if s.tree_tokens >= MIN_SHARED_PREFIX]
        if not cands:
            return None
        # Running rows count too: the first of a fan-out often joins alone (the others wait for its
        # prefix to be cached) and would otherwise keep every later row as long as itself.
        running = [s for s in batch.running if s.tree_tokens >= MIN_SHARED_PREFIX]
        if not _hold(batch, radix, cands[0], [*cands[1:], *running], lambda s: s.tree_tokens):
            return None
    shared = batch.shared
    return [continues_shared(s, shared, s.tree_tokens) for s in seqs]


def share_for_prefill(batch, radix, group: list) -> None:
    """Before a prefill group's rows are opened (``paged_prefill``): when two or more of them continue one
    cached prefix of at least ``MIN_SHARED_PREFIX`` tokens and the batch holds none, the batch holds it
    now, so the group's prefill reads it once for all its rows (cascade attention) and the rows never
    hold it; the decode steps after read the same copy."""
    if batch.shared is not None or radix is None:
        return
    cands = [s for s in group if not s.embedding and s.cached_tokens >= MIN_SHARED_PREFIX]
    if len(cands) > 1:
        _hold(batch, radix, cands[0], cands[1:], lambda s: s.cached_tokens)


def _hold(batch, radix, first_seq, others: list, tree_tokens) -> bool:
    """Make the longest prefix ``first_seq`` and at least one of ``others`` continue (each only as far as
    ``tree_tokens(seq)``: tokens whose KV is bitwise the tree's) the batch's shared prefix, if it is at
    least ``MIN_SHARED_PREFIX`` tokens and the tree holds it; running rows continuing it adopt it."""
    first, ns = first_seq.prompt_ids, first_seq.adapter_key
    head = first[:MIN_SHARED_PREFIX]
    group = [s for s in others
             if s.adapter_key == ns and s.prompt_ids[:MIN_SHARED_PREFIX] == head]  # one adapter's KV only
    if not group:
        return False
    length = min(tree_tokens(s) for s in [first_seq, *group])
    for s in group:
        length = common_prefix_len(first, s.prompt_ids, length)
    match = radix.match(first[:length], record=False, ns=ns)
    if length < MIN_SHARED_PREFIX or match.length != length:
        return False
    node = match.node
    radix.pin(node)
    # One node: the batch reads the node's own arrays (a paged node turns into arrays and gives its
    # pages back; rows that borrowed them drop them when they adopt the prefix): held once.
    single = len(match.nodes()) == 1
    kv = list(radix.own_arrays(node)) if single else radix.gather(match)
    if not single:  # a concatenation (read from pages): made now, so it holds no reference to a pool
        mx.eval([a for k, v in kv for x in (k, v) for a in kvq.arrays(x)])
        batch.meter.wrote(*[x for k, v in kv for x in (k, v)])  # a second copy beside the tree's pages
    batch.set_shared(SharedPrefix(first[:length], kv, release=lambda: radix.unpin(node),
                                  tree_node=node if single else None))
    batch.shared.adapter_key = ns
    adopters = {id(s) for s in batch.running if continues_shared(s, batch.shared, s.tree_tokens)}
    if adopters:
        batch.adopt_shared(adopters)
    return True


def continues_shared(seq, shared: SharedPrefix, tree_tokens: int) -> bool:
    """``seq``'s KV for the whole shared prefix is bitwise the tree's copy the batch holds (its first
    ``tree_tokens`` tokens are)."""
    return (tree_tokens >= shared.length and seq.adapter_key == getattr(shared, "adapter_key", None)
            and shared.continues(seq.prompt_ids))

