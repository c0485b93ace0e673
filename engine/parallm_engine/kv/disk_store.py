"""Blocks of KV on disk: the files of the prefix cache's disk tier (``disk_tier``), safe to share between
processes and to crash.

One file per block, ``<root>/<model>/<key[:2]>/<key>.kvb``: ``<model>`` names everything that makes KV
differ (``disk_tier.kv_fingerprint``), ``<key>`` is the block's chained hash. A file is

    MAGIC | meta length (8 bytes, little-endian) | meta (JSON) | payload | blake2b-256 of meta + payload

and the meta repeats the key, the fingerprint and the block's token ids: a truncated, corrupt or foreign
file (another model, a hash collision) fails the check and is deleted, never loaded. Files are written under
a temporary name in the same directory and renamed into place (atomic on POSIX and Windows), so a reader
sees a whole file or none, and a writer killed mid-write leaves only a temporary file nobody reads (removed
by a later sweep). The store's size is capped across every process sharing the directory: after a write the
writer takes the directory's lock and deletes the least recently used files (by modification time: a read
touches its file) until the whole directory is within the cap.

numpy only (no MLX): ``parallm cache`` lists and clears the store without loading a model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger("parallm_engine")

MAGIC = b"PLLMKV1\n"
SUFFIX = ".kvb"
DIGEST = 32
STALE_TMP_S = 3600  # a temporary file this old belongs to a writer that died


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST)
    for p in parts:
        h.update(p)
    return h.digest()


@dataclass
class Block:
    """A block read back: its token ids and its arrays (per layer keys and values, in the order written)."""

    tokens: list[int]
    arrays: list[np.ndarray]
    nbytes: int
    kind: str  # what the arrays hold, as the writer named it (e.g. the KV dtype stored in them)


def _to_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


class DiskStore:
    def __init__(self, root: Path, cap_bytes: int):
        self.root = Path(root)
        self.cap_bytes = int(cap_bytes)
        self.root.mkdir(parents=True, exist_ok=True)
        self.rejected = 0  # files that failed the check (deleted)

    def _path(self, model: str, key: str, after: str | None = None) -> Path:
        if after is not None:  # a tail: fewer tokens than a block, after the block keyed ``after``
            return self.root / model / "tails" / after / f"{key}{SUFFIX}"
        return self.root / model / key[:2] / f"{key}{SUFFIX}"

    def describe_model(self, model: str, about: dict) -> None:
        """What ``model`` (a fingerprint) is, for ``parallm cache`` (written once, atomically)."""
        path = self.root / model / "model.json"
        if not path.exists():
            self._write_atomic(path, json.dumps(about, sort_keys=True).encode())

    # -- write ----------------------------------------------------------------------------------
    def has(self, model: str, key: str, after: str | None = None) -> bool:
        return self._path(model, key, after).exists()

    def write(self, model: str, key: str, tokens: list[int], arrays: list[np.ndarray], kind: str = "",
              after: str | None = None) -> int:
        """Store a block (atomically; an existing file of the same key is left as it is), or a tail: the
        tokens after the block keyed ``after`` (fewer than a block; found by :meth:`tails`). Returns the bytes
        written (0 when it was already there)."""
        path = self._path(model, key, after)
        if path.exists():
            return 0
        layout, offset = [], 0
        for a in arrays:
            layout.append({"dtype": a.dtype.str, "shape": list(a.shape), "offset": offset, "nbytes": a.nbytes})
            offset += a.nbytes
        meta = json.dumps({"key": key, "model": model, "tokens": [int(t) for t in tokens], "kind": kind,
                           "arrays": layout}).encode()
        payload = [_to_bytes(a) for a in arrays]
        body = [MAGIC, len(meta).to_bytes(8, "little"), meta, *payload, _digest(meta, *payload)]
        self._write_atomic(path, body)
        size = sum(len(b) for b in body)
        self.enforce_cap()
        return size

    def _write_atomic(self, path: Path, data) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        try:
            with open(tmp, "wb") as f:
                for part in ([data] if isinstance(data, bytes) else data):
                    f.write(part)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    # -- read -----------------------------------------------------------------------------------
    def tails(self, model: str, after: str) -> list[tuple[str, list[int]]]:
        """The tails stored after the block keyed ``after``: (key, tokens) from each file's header (an
        unreadable one is left to :meth:`read` to reject)."""
        d = self.root / model / "tails" / after
        out = []
        try:
            names = [n for n in os.listdir(d) if n.endswith(SUFFIX)]
        except OSError:
            return out
        for name in names:
            try:
                with open(d / name, "rb") as f:
                    head = f.read(len(MAGIC) + 8)
                    if not head.startswith(MAGIC):
                        continue
                    n_meta = int.from_bytes(head[len(MAGIC) :], "little")
                    meta = json.loads(f.read(min(n_meta, 1 << 22)))
                out.append((name[: -len(SUFFIX)], [int(t) for t in meta["tokens"]]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    def read(self, model: str, key: str, tokens: list[int], after: str | None = None) -> Block | None:
        """The block (or tail) stored under ``key`` if it is whole, unaltered and holds exactly ``tokens``;
        else None (a damaged or foreign file is deleted)."""
        path = self._path(model, key, after)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError:
            logger.warning("could not read KV block %s", path, exc_info=True)
            return None
        block = self._parse(data, model, key, tokens)
        if block is None:
            self.rejected += 1
            logger.warning("ignored a damaged or foreign KV block file %s", path)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recently used: the cap evicts others first
        except OSError:
            pass
        return block

    @staticmethod
    def _parse(data: bytes, model: str, key: str, tokens: list[int]) -> Block | None:
        head = len(MAGIC) + 8
        if len(data) < head + DIGEST or not data.startswith(MAGIC):
            return None
        n_meta = int.from_bytes(data[len(MAGIC) : head], "little")
        if head + n_meta + DIGEST > len(data):
            return None
        meta_raw = data[head : head + n_meta]
        payload = memoryview(data)[head + n_meta : len(data) - DIGEST]
        if _digest(meta_raw, payload) != data[len(data) - DIGEST :]:
            return None
        try:
            meta = json.loads(meta_raw)
            if meta["key"] != key or meta["model"] != model or meta["tokens"] != list(tokens):
                return None
            arrays = []
            for a in meta["arrays"]:
                end = a["offset"] + a["nbytes"]
                if end > len(payload):
                    return None
                arrays.append(np.frombuffer(payload[a["offset"] : end], dtype=np.dtype(a["dtype"]))
                              .reshape(a["shape"]))
        except (KeyError, TypeError, ValueError):
            return None
        return Block(list(tokens), arrays, len(payload), str(meta.get("kind", "")))

    # -- the cap --------------------------------------------------------------------------------
    @contextmanager
    def _locked(self):
        """The directory's lock (advisory, between processes; a no-op where ``fcntl`` is missing)."""
        try:
            import fcntl
        except ImportError:  # Windows: one writer's sweep may race another's; files stay whole either way
            yield
            return
        with open(self.root / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _files(self):
        """Every block file and stray temporary file: (path, size, mtime)."""
        out = []
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                if name.endswith(SUFFIX) or name.endswith(".tmp"):
                    p = Path(dirpath) / name
                    try:
                        st = p.stat()
                    except FileNotFoundError:
                        continue
                    out.append((p, st.st_size, st.st_mtime))
        return out

    def enforce_cap(self) -> int:
        """Delete least recently used blocks until the directory is within the cap; returns bytes deleted."""
        deleted = 0
        with self._locked():
            files = self._files()
            now = time.time()
            blocks = []
            for p, size, mtime in files:
                if p.name.endswith(".tmp"):
                    if now - mtime > STALE_TMP_S:
                        p.unlink(missing_ok=True)
                    continue
                blocks.append((mtime, size, p))
            total = sum(size for _, size, _ in blocks)
            for _, size, p in sorted(blocks):
                if total <= self.cap_bytes:
                    break
                p.unlink(missing_ok=True)
                total -= size
                deleted += size
        return deleted

    # -- what is stored (parallm cache) ---------------------------------------------------------
    def models(self) -> list[dict]:
        """Per model directory: what it is (``model.json``), its blocks and bytes."""
        out = []
        if not self.root.exists():
            return out
        for d in sorted(p for p in self.root.iterdir() if p.is_dir()):
            about = {}
            try:
                about = json.loads((d / "model.json").read_text())
            except (OSError, ValueError):
                pass
            files = [p for p in d.rglob(f"*{SUFFIX}")]
            out.append({"fingerprint": d.name, **about, "blocks": len(files),
                        "bytes": sum(p.stat().st_size for p in files if p.exists())})
        return out

    def total_bytes(self) -> int:
        return sum(size for p, size, _ in self._files() if p.name.endswith(SUFFIX))

    def clear(self, model: str | None = None) -> int:
        """Delete every block (of ``model`` only, a fingerprint or a prefix of one); returns bytes deleted."""
        deleted = 0
        with self._locked():
            for p, size, _ in self._files():
                rel = p.relative_to(self.root).parts
                if model is None or (rel and rel[0].startswith(model)):
                    p.unlink(missing_ok=True)
                    deleted += size
        return deleted
