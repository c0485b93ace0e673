"""The ranks of a distributed engine and the one channel its control messages take.

``mx.distributed.init()`` picks the backend ``mlx.launch`` set up (ring over TCP / Thunderbolt, JACCL over
RDMA, MPI, NCCL on CUDA); this module adds nothing of its own below it. Rank 0 plans; what the other ranks
must hear from it (the requests it took, each step's plan) is pickled and sent with ``all_sum`` over the
group on the CPU stream (the other ranks add zeros): two small collectives per message, the same on every
backend. The ranks are one program launched together on machines the user trusts (``mlx.launch``'s own
model), which is why pickle is acceptable on this channel and nowhere else.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import time
from dataclasses import dataclass, field

import numpy as np

from parallm_engine.errors import DistributedError

MODES = ("pipeline", "tensor")


@dataclass
class DistributedGroup:
    """This process's place in the group: ``mode`` ("pipeline" or "tensor"), ``rank``, ``size``."""

    mode: str
    group: object  # mx.distributed.Group
    rank: int
    size: int
    backend: str
    comm_s: float = 0.0  # seconds spent in control messages (rank 0: sending; others: waiting included)
    messages: int = 0
    shard: dict = field(default_factory=dict)  # what this rank holds (sharding.describe)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- the control channel ------------------------------------------------------------------------
    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (the others pass nothing and get rank 0's)."""
        import mlx.core as mx

        t0 = time.perf_counter()
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.leader else b""
        n = mx.distributed.all_sum(mx.array([len(data)], dtype=mx.int32), group=self.group, stream=mx.cpu)
        size = int(n.item())
        buf = mx.array(np.frombuffer(data, dtype=np.uint8)) if self.leader else mx.zeros((size,), dtype=mx.uint8)
        out = mx.distributed.all_sum(buf, group=self.group, stream=mx.cpu)
        mx.eval(out)
        self.comm_s += time.perf_counter() - t0
        self.messages += 1
        return obj if self.leader else pickle.loads(np.array(out).tobytes())

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length on every rank), by rank."""
        import mlx.core as mx

        arr = mx.array(np.asarray(values, dtype=np.int64).view(np.int32))
        out = mx.distributed.all_gather(arr, group=self.group, stream=mx.cpu)
        rows = np.array(out).view(np.int64).reshape(self.size, len(values))
        return rows.tolist()

    def agree(self, what: str, value) -> None:
        """Every rank must hold the same ``value`` (a configuration, a model's files): a typed error names
        the ranks that differ."""
        digest = int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:7], "little")
        got = [row[0] for row in self.gather_ints([digest])]
        differ = [r for r, d in enumerate(got) if d != got[0]]
        if differ:
            raise DistributedError(f"ranks {differ} disagree with rank 0 about {what}; every rank must run the same "
                                   "command on the same model files")

    def seed(self) -> int:
        """One random seed for every rank (rank 0's): unseeded sampling draws the same on each."""
        return self.broadcast(random.getrandbits(62) if self.leader else None)

    def describe(self) -> dict:
        return {"mode": self.mode, "rank": self.rank, "size": self.size, "backend": self.backend,
                "control_messages": self.messages, "control_s": round(self.comm_s, 4), **self.shard}


def init_group(mode: str, backend: str = "any") -> DistributedGroup:
    """Join the group ``mlx.launch`` started (typed errors: an unknown mode, or a single process)."""
    import mlx.core as mx

    if mode not in MODES:
        raise DistributedError(f"distributed must be one of {', '.join(MODES)}, got {mode!r}", supported=list(MODES))
    if not mx.distributed.is_available():
        raise DistributedError("this MLX build has no distributed backend")
    group = mx.distributed.init(backend=backend)
    if group.size() < 2:
        raise DistributedError(
            f"distributed={mode!r} needs several ranks: start the program with mlx.launch, e.g. "
            "`mlx.launch -n 2 --backend ring -- parallm serve --distributed pipeline` (one machine) or "
            "`mlx.launch --hostfile hosts.json -- ...` (docs/distributed.md)")
    name = _backend_name(backend)
    return DistributedGroup(mode=mode, group=group, rank=group.rank(), size=group.size(), backend=name)


def _backend_name(asked: str) -> str:
    import os

    if asked != "any":
        return asked
    if os.environ.get("MLX_JACCL_COORDINATOR") or os.environ.get("MLX_IBV_DEVICES"):
        return "jaccl"
    if os.environ.get("MLX_HOSTFILE") or os.environ.get("MLX_RING_VERBOSE") is not None:
        return "ring"
    if os.environ.get("OMPI_COMM_WORLD_SIZE"):
        return "mpi"
    if os.environ.get("NCCL_HOST_IP") or os.environ.get("MLX_NCCL"):
        return "nccl"
    return "ring"
