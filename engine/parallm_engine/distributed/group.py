"""The ranks of a distributed engine and the one channel its control messages take.

``mx.distributed.init()`` picks the backend ``mlx.launch`` set up (ring over TCP / Thunderbolt, JACCL over
RDMA, MPI, NCCL on CUDA); this module adds nothing of its own below it. Rank 0 plans; what the other ranks
must hear from it (the requests it took, each step's plan) is pickled and sent with ``all_sum`` over the
group on the CPU stream (the other ranks add zeros): one small collective per message (two for a long one),
the same on every backend. The ranks are one program launched together on machines the user trusts (``mlx.launch``'s own
model), which is why pickle is acceptable on this channel and nowhere else.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import socket
import time
from dataclasses import dataclass, field

import numpy as np

from parallm_engine.errors import DistributedError

MODES = ("pipeline", "tensor")
FRAME = 4096  # bytes of a control message's first (often only) collective


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
    shard: dict = field(default_factory=dict)  # what this rank holds (sharding.shard_model)
    idle: object = None  # the IdleLink the other ranks wait on while rank 0 is idle (None: they wait in the group)
    # Each rank's memory by rank: weights (at load), KV held and MLX's active bytes (every MEMORY_EVERY steps).
    rank_memory: list = field(default_factory=list)
    probe: object = None  # the step's communication time (comm_probe.CommProbe), once the model is split

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- the control channel ------------------------------------------------------------------------
    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (the others pass nothing and get rank 0's). One collective for a
        message up to ``FRAME`` bytes (a step's plan is a few hundred), a second for the rest of a longer one."""
        import mlx.core as mx

        t0 = time.perf_counter()
        frame = np.zeros(FRAME, dtype=np.uint8)
        data = b""
        if self.leader:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            frame[:8] = np.frombuffer(len(data).to_bytes(8, "little"), dtype=np.uint8)
            head = data[: FRAME - 8]
            frame[8 : 8 + len(head)] = np.frombuffer(head, dtype=np.uint8)
        # summed as int32 words (the zeros the other ranks add leave rank 0's bytes as they are)
        got = np.array(mx.distributed.all_sum(mx.array(frame.view(np.int32)), group=self.group,
                                              stream=mx.cpu)).view(np.uint8)
        size = int.from_bytes(got[:8].tobytes(), "little")
        body = got[8 : 8 + min(size, FRAME - 8)].tobytes()
        if size > FRAME - 8:  # the rest of a long message (many requests added in one step)
            rest = np.frombuffer(data[FRAME - 8 :], dtype=np.uint8) if self.leader \
                else np.zeros(size - (FRAME - 8), dtype=np.uint8)
            body += np.array(mx.distributed.all_sum(mx.array(rest), group=self.group, stream=mx.cpu)).tobytes()[
                : size - (FRAME - 8)]
        self.comm_s += time.perf_counter() - t0
        self.messages += 1
        return obj if self.leader else pickle.loads(body)

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

    def gather_memory(self, weights: int, kv_held: int, active: int) -> None:
        """Every rank's memory, on every rank (a collective: every rank calls it at the same step)."""
        start, end = self.shard.get("layers", (0, 0))
        rows = self.gather_ints([weights, kv_held, active, start, end])
        self.rank_memory = [{"rank": r, "weights_bytes": w, "kv_bytes_held": k, "mlx_active_bytes": a,
                             "layers": [s, e]} for r, (w, k, a, s, e) in enumerate(rows)]

    def describe(self) -> dict:
        return {"mode": self.mode, "rank": self.rank, "size": self.size, "backend": self.backend,
                "control_messages": self.messages, "control_s": round(self.comm_s, 4),
                "ranks": list(self.rank_memory), **self.shard,
                **({"comm": self.probe.describe()} if self.probe is not None else {})}


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


class IdleLink:
    """Where the other ranks wait while rank 0 has nothing to do: a plain TCP connection to rank 0. A
    collective's wait polls (MLX's ring backend keeps a core busy); a blocked socket read does not. Rank 0
    sends ``park`` through the group when it goes idle and one byte on each connection when it has a step again.
    Set up with every rank taking part; where a rank cannot reach rank 0 this way, nobody parks."""

    def __init__(self, dist: DistributedGroup):
        self.dist = dist
        self.conns: list = []  # rank 0: one per other rank
        self.conn = None  # another rank: its connection to rank 0
        self.parked = False
        server = None
        if dist.leader:
            server = socket.create_server(("", 0), backlog=dist.size)
            where = {"hosts": _leader_hosts(), "port": server.getsockname()[1]}
        else:
            where = None
        where = dist.broadcast(where)
        if not dist.leader:
            self.conn = _connect(where["hosts"], where["port"])
        ok = all(row[0] for row in dist.gather_ints([1 if dist.leader or self.conn is not None else 0]))
        if dist.leader:
            if ok:
                server.settimeout(30)
                self.conns = [server.accept()[0] for _ in range(dist.size - 1)]
            server.close()
        elif not ok and self.conn is not None:
            self.conn.close()
            self.conn = None

    @property
    def usable(self) -> bool:
        return bool(self.conns) or self.conn is not None

    def wake(self) -> None:
        """Rank 0: the parked ranks come back to the group's collectives."""
        if self.parked:
            for c in self.conns:
                c.sendall(b"w")
            self.parked = False

    def wait(self) -> bool:
        """Another rank: block until rank 0 wakes it (True) or its connection ends (False: rank 0 is gone)."""
        try:
            return self.conn.recv(1) == b"w"
        except OSError:
            return False


def _leader_hosts() -> list[str]:
    """Addresses the other ranks may reach rank 0 at: its ring address (``MLX_HOSTFILE``), the JACCL
    coordinator's, then this host's names."""
    import json
    import os

    hosts: list[str] = []
    try:
        ring = json.loads(open(os.environ["MLX_HOSTFILE"]).read())
        hosts += [a.rsplit(":", 1)[0] for a in ring[0]]
    except (KeyError, OSError, ValueError, IndexError, TypeError):
        pass
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        hosts.append(coordinator.rsplit(":", 1)[0])
    try:
        hosts += sorted({info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)})
    except OSError:
        pass
    return list(dict.fromkeys(hosts + ["127.0.0.1"]))


def _connect(hosts: list[str], port: int):
    for host in hosts:
        try:
            conn = socket.create_connection((host, port), timeout=3)
        except OSError:
            continue
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn
    return None
