"""The prefix cache's disk tier: prefixes the radix tree lets go of are kept on disk, and a later prompt (in
this process or the next) that starts with one reads it back instead of computing it again.

Blocks of ``BLOCK_TOKENS`` tokens, aligned from the context's first token, keyed by a chained hash: block i's
key hashes block i-1's key and its own tokens, and the chain starts from everything that makes KV differ
(``kv_fingerprint``: the model's files, the engine path and weight storage, the KV format; the LoRA adapter
per chain). A different model, adapter or version never matches; the file's own check (``disk_store``)
catches the rest.

- **Out** (write-behind): when the tree evicts a leaf, the blocks whose last token is in that leaf are copied
  off the device on the engine thread and written by a writer thread (a bounded queue: when disk falls
  behind, blocks are dropped, never waited for); at shutdown every block of the tree is written.
- **In**: when a request arrives, the blocks continuing what the tree holds are read in the background if
  reading is faster than computing them (``worth_reading``: the measured read rate against the measured
  prefill rate; reading is assumed faster until one read is measured); when the request is admitted, they
  are inserted into the tree as a node of their own arrays, and its match finds them (a prefix-cache hit:
  the usage reports them as cached tokens).

Float KV of the paged layout only: quantized KV (``kv_bits``) and the mixed layout's snapshots are not stored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from parallm_engine.kv.disk_store import DiskStore

logger = logging.getLogger("parallm_engine")

BLOCK_TOKENS = 128
MIN_TAIL_TOKENS = 16  # a path's tokens after its last whole block are kept as a tail from this many on
FORMAT_VERSION = "1"
WRITE_QUEUE_BYTES = 512 << 20  # blocks waiting for the writer thread, at most
SAMPLE_BYTES = 1 << 20  # of each weight file's head and tail, in the model's fingerprint

# KV dtypes stored, and the unsigned type of the same width their bits travel in (numpy has no bfloat16).
_BITS = {"bfloat16": (mx.bfloat16, mx.uint16), "float16": (mx.float16, mx.uint16), "float32": (mx.float32, None)}


def model_files_fingerprint(path) -> dict:
    """What identifies a model's weights without reading them whole: its config, and each weight file's
    name, size and first and last MiB (random-weight models of one config differ there)."""
    path = Path(path)
    h = hashlib.blake2b(digest_size=16)
    files = sorted(p for p in ([path] if path.is_file() else path.iterdir())
                   if p.is_file() and p.suffix in (".safetensors", ".gguf", ".npz", ".json", ".bin"))
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(SAMPLE_BYTES))
            if size > 2 * SAMPLE_BYTES:
                f.seek(size - SAMPLE_BYTES)
                h.update(f.read(SAMPLE_BYTES))
    return {"files": h.hexdigest(), "path": str(path)}


def kv_fingerprint(model_files: str, **settings) -> str:
    """The disk tier's namespace for one engine's KV: the model's files and every setting that changes the
    KV's bits (engine path, weight storage, KV dtype and format)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps({"v": FORMAT_VERSION, "files": model_files, **settings}, sort_keys=True,
                        default=str).encode())
    return h.hexdigest()


def chain_seed(fingerprint: str, ns) -> bytes:
    """Where the chain of block keys starts, for one engine's KV under adapter namespace ``ns``."""
    return hashlib.blake2b(f"{fingerprint}|{ns}".encode(), digest_size=20).digest()


def tail_key(after: str, tokens: list[int]) -> str:
    """A tail's key: the block it follows (hex key, or the chain's seed) and its tokens."""
    h = hashlib.blake2b(bytes.fromhex(after), digest_size=20)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.hexdigest()


def block_keys(fingerprint: str, ns, tokens: list[int]) -> list[str]:
    """The chained key of each complete block of ``tokens`` under adapter namespace ``ns``."""
    prev = chain_seed(fingerprint, ns)
    keys = []
    for i in range(len(tokens) // BLOCK_TOKENS):
        h = hashlib.blake2b(prev, digest_size=20)
        h.update(np.asarray(tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS], dtype=np.int64).tobytes())
        prev = h.digest()
        keys.append(prev.hex())
    return keys


DEFAULT_CAP_BYTES = 16 << 30
DEFAULT_FREE_SHARE = 0.1  # at most this share of the disk's free space, by default


def default_root() -> Path:
    from parallm_engine import settings
    from parallm_engine.models.gguf import default_cache_dir

    return Path(settings.kv_disk_dir() or default_cache_dir() / "kv")


def resolve_cap(kv_disk, root: Path) -> int:
    """``kv_disk`` (an ``Engine`` option: None for the default, 0 for off, bytes, or a size such as "8GiB") as
    bytes. The default: ``PARALLM_KV_DISK`` if set, else 16 GiB or a tenth of the disk's free space, less."""
    import shutil

    from parallm_engine import settings
    from parallm_engine.errors import InvalidRequestError

    if kv_disk is None:
        kv_disk = settings.kv_disk()
    if kv_disk is None:
        probe = root
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        try:
            free = shutil.disk_usage(probe).free
        except OSError:
            return 0
        return int(min(DEFAULT_CAP_BYTES, free * DEFAULT_FREE_SHARE))
    if isinstance(kv_disk, bool) or not isinstance(kv_disk, (int, str)):
        raise InvalidRequestError(f"kv_disk must be a size in bytes, a size such as '8GiB', 0 (off) or None, "
                                  f"got {kv_disk!r}", param="kv_disk")
    try:
        cap = settings.parse_size(kv_disk) if isinstance(kv_disk, str) else int(kv_disk)
    except ValueError:
        raise InvalidRequestError(f"kv_disk: not a size: {kv_disk!r}", param="kv_disk") from None
    if cap < 0:
        raise InvalidRequestError(f"kv_disk must be >= 0, got {kv_disk!r}", param="kv_disk")
    return cap


@dataclass
class DiskTierConfig:
    root: Path
    cap_bytes: int
    model_files: str  # model_files_fingerprint(...)["files"]
    about: dict = field(default_factory=dict)  # what the model is, for parallm cache


@dataclass
class PendingRead:
    """A read started for a prompt: the tokens [start, start + n) it is expected to give."""

    future: Future
    start: int
    n: int


@dataclass
class Restore:
    """Blocks read for a prompt: its tokens [start, start + n) per layer as host arrays."""

    start: int
    n: int
    layers: list  # per layer (keys, values), numpy, (1, H, n, D)
    nbytes: int
    seconds: float
    kind: str  # the KV dtype's name


class DiskTier:
    def __init__(self, cfg: DiskTierConfig, fingerprint: str):
        self.store = DiskStore(cfg.root, cfg.cap_bytes)
        self.model = fingerprint
        self.store.describe_model(fingerprint, cfg.about)
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._queued_keys: set[str] = set()  # blocks queued and not yet written (two leaves share a path)
        self._lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="parallm-kv-disk-writer", daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="parallm-kv-disk-reader")
        self._reads: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # reads in use, shared
        self.read_rate: float | None = None  # bytes per second, measured
        # stats
        self.blocks_queued = 0  # blocks handed to the writer: a lookup that found nothing is stale once it grows
        self.blocks_written = self.bytes_written = self.writes_dropped = 0
        self.blocks_read = self.bytes_read = 0
        self.hit_tokens = 0
        self.read_s = self.write_s = 0.0
        self.skipped_slower = 0  # restores not done: computing was estimated faster

    # -- out --------------------------------------------------------------------------------------
    def save(self, ns, nodes: list, kv_of, only_last: bool) -> None:
        """Write the blocks of the path ``nodes`` (root's child first) that are not on disk: those whose last
        token is in the last node (``only_last``: a leaf being evicted), or every complete one; and the path's
        tail (its tokens after the last whole block, from ``MIN_TAIL_TOKENS`` on).
        ``kv_of(node)``: the node's KV, per layer (keys, values) of (1, H, n, D)."""
        tokens = [t for nd in nodes for t in nd.tokens]
        keys = block_keys(self.model, ns, tokens)
        first = (len(tokens) - len(nodes[-1].tokens)) // BLOCK_TOKENS if only_last else 0
        # (index, key, after, [a, b)): whole blocks, then the tail (after: the block it follows)
        jobs = [(i, keys[i], None, i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS) for i in range(first, len(keys))]
        a = len(keys) * BLOCK_TOKENS
        if len(tokens) - a >= MIN_TAIL_TOKENS:
            after = keys[-1] if keys else chain_seed(self.model, ns).hex()
            jobs.append((len(keys), tail_key(after, tokens[a:]), after, a, len(tokens)))
        jobs = [j for j in jobs if j[1] not in self._queued_keys and not self.store.has(self.model, j[1], j[2])]
        if not jobs:
            return
        bounds, pos = [], 0
        for nd in nodes:
            bounds.append((pos, pos + len(nd.tokens), nd))
            pos += len(nd.tokens)
        for _, key, after, a, b in jobs:
            parts = [(kv_of(nd), max(a, s) - s, min(b, e) - s) for s, e, nd in bounds if s < b and e > a]
            layers = []
            for l in range(len(parts[0][0])):
                k = mx.concatenate([kv[l][0][..., lo:hi, :] for kv, lo, hi in parts], axis=2)
                v = mx.concatenate([kv[l][1][..., lo:hi, :] for kv, lo, hi in parts], axis=2)
                layers += [k, v]
            kind = _dtype_name(layers[0].dtype)
            if kind not in _BITS:
                return  # (not a float KV: nothing stored)
            bits = _BITS[kind][1]
            arrays = [np.array(x.view(bits) if bits is not None else x) for x in layers]
            nbytes = sum(x.nbytes for x in arrays)
            with self._lock:
                if self._queued_bytes + nbytes > WRITE_QUEUE_BYTES:
                    self.writes_dropped += 1
                    continue
                self._queued_bytes += nbytes
                self._queued_keys.add(key)
                self.blocks_queued += 1
            self._queue.put((key, tokens[a:b], arrays, nbytes, kind, after))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            key, tokens, arrays, nbytes, kind, after = item
            t0 = time.perf_counter()
            try:
                written = self.store.write(self.model, key, tokens, arrays, kind, after=after)
                if written:
                    self.blocks_written += 1
                    self.bytes_written += written
            except OSError:
                logger.warning("could not write a KV block to %s", self.store.root, exc_info=True)
            finally:
                self.write_s += time.perf_counter() - t0
                with self._lock:
                    self._queued_bytes -= nbytes
                    self._queued_keys.discard(key)
                self._queue.task_done()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the blocks queued so far are written (at most ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._reader.shutdown(wait=False, cancel_futures=True)

    # -- in ---------------------------------------------------------------------------------------
    def worth_reading(self, n_tokens: int, nbytes: int, prefill_rate: float | None) -> bool:
        """Reading ``nbytes`` is estimated faster than prefilling ``n_tokens`` at the measured rates."""
        return reading_is_faster(n_tokens, nbytes, self.read_rate, prefill_rate)

    def prefetch(self, ns, tokens: list[int], start: int, bytes_per_token: int,
                 prefill_rate: float | None) -> list[PendingRead]:
        """Start reading what the disk holds of ``tokens`` past ``start`` (what the tree holds) in the
        background: the run of whole blocks (one read, shared by every prompt that asks for the same run),
        then the longest stored tail that ``tokens`` continue. Empty when the disk holds nothing useful or
        computing it is estimated faster."""
        keys = block_keys(self.model, ns, tokens)
        first = start // BLOCK_TOKENS
        run = sum(1 for _ in _prefix_run(self.store, self.model, keys[first:]))
        pos = (first + run) * BLOCK_TOKENS
        after = keys[first + run - 1] if first + run else chain_seed(self.model, ns).hex()
        tail = None
        if first + run == len(keys):  # (a missing block ends the run: a tail after it would not continue it)
            best = 0
            for key, stored in self.store.tails(self.model, after):
                m = _common(stored, tokens, pos)
                if m > best:
                    best, tail = m, (key, stored, m)
            if tail is not None and (best < MIN_TAIL_TOKENS or pos + best <= start):
                tail = None
        n = run * BLOCK_TOKENS + (tail[2] if tail else 0)
        if first * BLOCK_TOKENS + n <= start:
            return []
        if not self.worth_reading(first * BLOCK_TOKENS + n - start, n * bytes_per_token, prefill_rate):
            self.skipped_slower += 1
            return []
        reads = []
        if run:
            reads.append(self._shared_read([(k, None, tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS])
                                            for i, k in enumerate(keys[first : first + run], first)],
                                           first * BLOCK_TOKENS, run * BLOCK_TOKENS))
        if tail is not None:
            key, stored, m = tail
            reads.append(self._shared_read([(key, after, stored)], pos, m))
        return reads

    def _shared_read(self, parts: list[tuple], start: int, n: int) -> PendingRead:
        """The read of ``parts`` (see :meth:`_read`), started once for every prompt that asks for it while it
        is in use (the choices of one request, prompts sharing a system prompt)."""
        ident = (start, n, tuple(key for key, _, _ in parts))
        with self._lock:
            read = self._reads.get(ident)
            if read is None:
                read = self._reads[ident] = PendingRead(self._reader.submit(self._read, parts, start, n), start, n)
        return read

    def _read(self, parts: list[tuple], start: int, n: int) -> Restore | None:
        """Files ``parts`` ((key, after, tokens) each) in order, as one restore of tokens [start, start + n):
        the leading files that are whole and of one KV dtype (the rest is computed instead)."""
        t0 = time.perf_counter()
        blocks = []
        for key, after, stored in parts:
            block = self.store.read(self.model, key, stored, after=after)
            if block is None or (blocks and block.kind != blocks[0].kind):
                n = sum(len(b.tokens) for b in blocks)
                break
            blocks.append(block)
        if not blocks or blocks[0].kind not in _BITS:
            return None
        layers = []
        for j in range(0, len(blocks[0].arrays), 2):
            k = np.concatenate([b.arrays[j] for b in blocks], axis=2)
            v = np.concatenate([b.arrays[j + 1] for b in blocks], axis=2)
            layers.append((k, v))
        seconds = time.perf_counter() - t0
        nbytes = sum(b.nbytes for b in blocks)
        rate = nbytes / max(seconds, 1e-6)
        self.read_rate = rate if self.read_rate is None else 0.7 * self.read_rate + 0.3 * rate
        self.blocks_read += len(blocks)
        self.bytes_read += nbytes
        self.read_s += seconds
        return Restore(start, n, layers, nbytes, seconds, blocks[0].kind)

    def device_layers(self, restore: Restore, start: int, end: int) -> list:
        """Tokens [start, end) of a restore as device arrays of the KV's dtype, per layer (keys, values)."""
        a, b = start - restore.start, end - restore.start
        dtype, bits = _BITS[restore.kind]

        def device(x: np.ndarray) -> mx.array:
            y = mx.array(np.ascontiguousarray(x[..., a:b, :]))
            return y.view(dtype) if bits is not None else y

        return [(device(k), device(v)) for k, v in restore.layers]

    def stats(self) -> dict:
        return {
            "kv_disk_hit_tokens": self.hit_tokens,
            "kv_disk_blocks_read": self.blocks_read,
            "kv_disk_bytes_read": self.bytes_read,
            "kv_disk_read_s": round(self.read_s, 4),
            "kv_disk_blocks_written": self.blocks_written,
            "kv_disk_bytes_written": self.bytes_written,
            "kv_disk_write_s": round(self.write_s, 4),
            "kv_disk_writes_dropped": self.writes_dropped,
            "kv_disk_restores_skipped_slower": self.skipped_slower,
            "kv_disk_rejected_files": self.store.rejected,
            "kv_disk_cap_bytes": self.store.cap_bytes,
        }


def reading_is_faster(n_tokens: int, nbytes: int, read_rate: float | None, prefill_rate: float | None) -> bool:
    """The disk tier's rule: read ``nbytes`` back rather than prefill ``n_tokens`` when reading takes less time
    at the measured rates (bytes / tokens a second). Reading is tried while either is unmeasured: the first
    read measures it."""
    if not read_rate or not prefill_rate:
        return True
    return nbytes / read_rate < n_tokens / prefill_rate


def _common(stored: list[int], tokens: list[int], pos: int) -> int:
    """Leading tokens of ``stored`` that ``tokens`` has from ``pos`` on."""
    n = min(len(stored), len(tokens) - pos)
    i = 0
    while i < n and stored[i] == tokens[pos + i]:
        i += 1
    return i


def _prefix_run(store: DiskStore, model: str, keys: list[str]):
    """The leading keys whose block files exist."""
    for key in keys:
        if not store.has(model, key):
            return
        yield key


def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]
