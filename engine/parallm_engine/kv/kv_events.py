"""KV events: what the prefix cache holds, published for routers outside the engine.

A router that sends each request to the replica holding the longest cached prefix of its prompt (llm-d's
precise prefix scorer, Dynamo's KV router) learns what each replica holds from KV events in vLLM's format
(``vllm.distributed.kv_events``): batches of ``BlockStored`` (a run of blocks now held: their hashes, the
parent block's hash, their token ids, the block size, the LoRA id, the medium), ``BlockRemoved`` (hashes no
longer held) and ``AllBlocksCleared``, msgpack-encoded as msgspec's tagged array-like structs, sent on a ZMQ
PUB socket as ``[topic, sequence number (8 bytes, big-endian), payload]``; an optional ROUTER socket replays
the batches from a sequence number on (ending with sequence -1 and an empty payload), as vLLM's does.

The radix tree's edges have any length; the events speak of fixed blocks of ``block_size`` tokens from the
start of the context: block k is held while the tree holds its last token's position (a node inserted over
positions [a, b) stores the blocks whose last token lies there; removing it removes them; a split divides
them). Block hashes chain: each covers its parent's hash, the adapter namespace and its own tokens, so equal
hashes mean equal prefixes. Routers that hash tokens themselves read ``token_ids``.

:class:`KVEventLog` watches one tree (``RadixCache.events``, engine thread); the KV cache manager hands what
a step produced to a :class:`KVEventPublisher` (its own thread: the engine never waits on a socket).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
DEFAULT_TOPIC = "kv-events"
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


# -- the tree's blocks ----------------------------------------------------------------------------
def block_hashes(tokens, ns=None, block_size: int = DEFAULT_BLOCK_SIZE, upto: int | None = None) -> list[int]:
    """The chained hashes of the whole blocks of ``tokens`` (the first ``upto`` of them): 63-bit ints."""
    n = len(tokens) // block_size if upto is None else upto
    salt = b"" if ns is None else str(ns).encode()
    out, parent = [], b""
    for k in range(n):
        h = hashlib.blake2b(parent + salt + array("q", tokens[k * block_size : (k + 1) * block_size]).tobytes(),
                            digest_size=8).digest()
        out.append(int.from_bytes(h, "big") >> 1)
        parent = h
    return out


def lora_id(ns) -> int | None:
    """A stable int for an adapter namespace (the same adapter on every replica: the same id)."""
    return None if ns is None else int.from_bytes(hashlib.blake2b(str(ns).encode(), digest_size=4).digest(), "big")


class KVEventLog:
    """Block events of one radix tree, kept until :meth:`take` (engine thread only)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, medium: str | None = None):
        self.block_size = block_size
        self.medium = medium
        from parallm_engine.kv import kv_event_types as wire  # msgspec: only where events are on

        self._wire = wire
        self.pending: list = []
        # node -> (its first token's position, [(a held block's last token position, its hash)])
        self._blocks: dict = {}

    def stored(self, ns, tokens, start: int, leaf) -> None:
        """``leaf`` now holds ``tokens[start:]`` (``tokens``: the whole context from the root)."""
        bs = self.block_size
        first, end = start // bs, len(tokens) // bs  # blocks whose last token lies in [start, len(tokens))
        held = []
        if first < end:
            hashes = block_hashes(tokens, ns, bs, upto=end)
            held = [((k + 1) * bs - 1, hashes[k]) for k in range(first, end)]
            self.pending.append(self._wire.BlockStored(hashes[first:end], hashes[first - 1] if first else None,
                                            list(tokens[first * bs : end * bs]), bs, lora_id(ns), self.medium))
        self._blocks[leaf] = (start, held)

    def split(self, lower, upper, k: int) -> None:
        """``lower``'s first ``k`` tokens moved to the new node ``upper`` (its parent)."""
        start, held = self._blocks.pop(lower, (0, []))
        cut = start + k
        self._blocks[upper] = (start, [b for b in held if b[0] < cut])
        self._blocks[lower] = (cut, [b for b in held if b[0] >= cut])

    def removed(self, leaf) -> None:
        _, held = self._blocks.pop(leaf, (0, []))
        if held:
            self.pending.append(self._wire.BlockRemoved([h for _, h in held], self.medium))

    def held(self) -> set[int]:
        """Every block hash the tree holds now (tests check the events against it)."""
        return {h for _, blocks in self._blocks.values() for _, h in blocks}

    def take(self) -> list:
        events, self.pending = self.pending, []
        return events


# -- settings -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVEventsConfig:
    """Where the events go: ``endpoint`` (a ZMQ address to bind, e.g. ``tcp://*:5557``), ``replay_endpoint``
    (None: no replay socket), ``topic``, ``block_size`` (tokens per block; routers must use the same)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = DEFAULT_TOPIC
    block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    def parse(cls, value) -> "KVEventsConfig | None":
        """``Engine(kv_events=)``: None (off), an endpoint string, or a dict of the fields."""
        from parallm_engine.errors import InvalidRequestError

        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = {"endpoint": value}
        if not isinstance(value, dict) or not isinstance(value.get("endpoint"), str) or not value["endpoint"]:
            raise InvalidRequestError(f"kv_events must be a ZMQ endpoint or a dict with one, got {value!r}",
                                      param="kv_events")
        unknown = set(value) - {"endpoint", "replay_endpoint", "topic", "block_size"}
        if unknown:
            raise InvalidRequestError(f"kv_events: unknown field(s) {sorted(unknown)}", param="kv_events")
        size = value.get("block_size", DEFAULT_BLOCK_SIZE)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidRequestError(f"kv_events block_size must be a positive integer, got {size!r}",
                                      param="kv_events")
        try:
            import msgspec  # noqa: F401
            import zmq  # noqa: F401
        except ImportError as exc:
            raise InvalidRequestError("kv_events needs pyzmq and msgspec (pip install pyzmq msgspec, or the "
                                      "`server` extra)", param="kv_events") from exc
        return cls(**value)

    def publisher(self) -> "KVEventPublisher":
        return KVEventPublisher(self.endpoint, self.replay_endpoint, self.topic)


# -- publishing -----------------------------------------------------------------------------------
class KVEventPublisher:
    """``[topic, seq, payload]`` on a ZMQ PUB socket bound to ``endpoint``; with ``replay_endpoint``, a ROUTER
    socket that resends the last ``buffer_steps`` batches from a sequence number on. Its own thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = DEFAULT_TOPIC,
                 buffer_steps: int = 10_000, hwm: int = 100_000):
        import msgspec
        import zmq

        from parallm_engine.kv.kv_event_types import KVEventBatch

        self._batch = KVEventBatch
        self.topic = topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=hwm)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # the port a ``:0`` bind got
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="parallm-kv-events")
        self._thread.start()

    def publish(self, events: list) -> None:
        """Queue one batch (engine thread: never blocks; a full queue drops the batch, counted)."""
        if not events:
            return
        try:
            self._queue.put_nowait(self._batch(ts=time.time(), events=events))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set() or not self._queue.empty():
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                batch = None
            if batch is not None:
                payload = self._encoder.encode(batch)
                seq = self.seq.to_bytes(8, "big")
                self._pub.send_multipart([self.topic, seq, payload])
                self._buffer.append((self.seq, payload))
                self.seq += 1
            if self._replay is not None and poller.poll(0):
                self._serve_replay()
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        client, start = frames[0], int.from_bytes(frames[-1], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", _END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
