"""KV events for prefix-aware routers (vLLM's format over ZMQ): whatever sequence of inserts, splits,
matches, pins and evictions the radix tree goes through, replaying its events gives exactly the blocks the
tree holds; an engine publishes them on a ZMQ PUB socket that a subscriber decodes with vLLM's own types
(copied here from vLLM's ``kv_events_subscriber.py`` example), with replay of missed batches."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from parallm_engine.kv.kv_events import KVEventLog, block_hashes, lora_id  # noqa: E402
from parallm_engine.kv.radix_cache import RadixCache  # noqa: E402

BS = 4


# -- a subscriber's types: vLLM's example, verbatim in shape ---------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def apply(held: dict, events) -> None:
    """What a router keeps: block hash -> (parent hash, tokens) from the events."""
    for ev in events:
        if isinstance(ev, BlockStored) or type(ev).__name__ == "BlockStored":
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                assert parent is None or parent in held, "a block stored before its parent"
                held[h] = (parent, ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
                parent = h
        elif type(ev).__name__ == "BlockRemoved":
            for h in ev.block_hashes:
                del held[h]  # KeyError: removed a block never stored (or twice)
        else:
            held.clear()


def tree_blocks(tree: RadixCache, block_size: int) -> set[int]:
    """The block hashes the tree holds, recomputed from its paths (independent of the log's bookkeeping)."""
    out = set()
    for ns, root in tree.roots.items():
        stack = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                path = prefix + child.tokens
                out.update(block_hashes(path, ns, block_size))
                stack.append((child, path))
    return out


def kv_for(tokens):
    def make(start, end):
        vals = mx.zeros((1, 1, end - start, 2), dtype=mx.float32)
        return [(vals, vals)]
    return make


tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=14)
ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), tokens_st, st.sampled_from([None, "lora-a"])),
    st.tuples(st.just("match"), tokens_st, st.sampled_from([None, "lora-a"])),
    st.tuples(st.just("pin"), tokens_st, st.sampled_from([None, "lora-a"])),
    st.tuples(st.just("evict"), st.integers(1, 400), st.none()),
    st.tuples(st.just("clear"), st.none(), st.none()),
), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_replayed_events_are_the_blocks_the_tree_holds(operations):
    tree = RadixCache(max_bytes=10**9)
    tree.events = KVEventLog(BS)
    held: dict = {}
    pins = []
    for op, arg, ns in operations:
        if op == "insert":
            tree.insert(arg, kv_for(arg), ns=ns)
        elif op == "match":
            tree.match(arg, ns=ns)
        elif op == "pin":
            m = tree.match(arg, ns=ns)
            tree.pin(m.node)
            pins.append(m.node)
        elif op == "evict":
            if pins and arg % 3 == 0:
                tree.unpin(pins.pop())
            tree.evict(arg)
        else:
            tree.clear()
        apply(held, tree.events.take())
        assert set(held) == tree_blocks(tree, BS) == tree.events.held()
    for h, (parent, toks) in held.items():  # each block's tokens and parent as the chain says
        assert len(toks) == BS and (parent is None or parent in held)


def test_block_hashes_chain_and_namespaces():
    a = block_hashes(list(range(12)), None, 4)
    assert len(a) == 3 and len(set(a)) == 3 and all(0 <= h < 2**63 for h in a)
    assert block_hashes(list(range(8)) + [99, 99, 99, 99], None, 4)[:2] == a[:2]  # a shared prefix: same hashes
    assert block_hashes([0, 0, 0, 9] + list(range(4, 12)), None, 4)[1:] != a[1:]  # a changed parent changes all after
    assert block_hashes(list(range(12)), "adapter", 4) != a and lora_id("adapter") != lora_id(None)


def _recv(sub, decoder, timeout_s: float = 10.0):
    """Every batch published until none arrives for 0.5 s (at most ``timeout_s``): [(seq, batch)]."""
    out, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline and sub.poll(500 if out else 3000):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv-events"
        out.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
    return out


def test_engine_publishes_what_its_prefix_cache_holds(tiny_model_dir):
    """A subscriber on the engine's endpoint follows the tree: prompts with a shared prefix store their
    blocks once (the shared ones are not stored twice), a prefix-cache reset removes them all, sequence
    numbers have no gap, and the replay socket resends missed batches from a number on."""
    from parallm_engine import Engine
    from parallm_engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        Engine(str(tiny_model_dir), kv_events={"endpoint": "tcp://127.0.0.1:*", "blocks": 3})
    eng = Engine(str(tiny_model_dir), decode_lanes=1,
                 kv_events={"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        pub = eng._scheduler.kv.events
        sub.connect(pub.endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
        time.sleep(0.3)  # a SUB socket misses what is published before it has joined
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        system = list(range(300, 364))  # 64 shared tokens: 4 blocks of 16
        prompts = [system + [400 + i] * 20 for i in range(3)]
        eng.generate(prompts, max_tokens=4, temperature=0)
        batches = _recv(sub, decoder)
        held: dict = {}
        stored = []
        for _, batch in batches:
            apply(held, batch.events)
            stored += [h for ev in batch.events if isinstance(ev, BlockStored) for h in ev.block_hashes]
        assert len(stored) == len(set(stored))  # the shared prefix's blocks stored once
        tree = eng._scheduler.kv.radix
        assert set(held) == eng.run_on_engine_thread(lambda: tree_blocks(tree, 16))
        shared = block_hashes(system, None, 16)
        assert set(shared) <= set(held)
        for p in prompts:  # every prompt's whole blocks are held (its context was committed)
            assert set(block_hashes(p, None, 16)) <= set(held)
        first = [ev for _, b in batches for ev in b.events if isinstance(ev, BlockStored)][0]
        assert first.block_size == 16 and first.lora_id is None and first.parent_block_hash is None

        eng.clear_prefix_cache()
        more = _recv(sub, decoder)
        for _, batch in more:
            apply(held, batch.events)
        assert held == {}
        seqs = [s for s, _ in batches + more]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap

        replay = ctx.socket(zmq.DEALER)  # replay from the second batch on: what a late subscriber asks
        replay.connect(pub.replay_endpoint)
        replay.send_multipart([b"", seqs[1].to_bytes(8, "big")])
        got = []
        while replay.poll(5000):
            _, seq, payload = replay.recv_multipart()
            if not payload:
                break
            got.append(int.from_bytes(seq, "big"))
        assert got == seqs[1:]
        replay.close(0)
    finally:
        sub.close(0)
        ctx.term()
        eng.shutdown()
