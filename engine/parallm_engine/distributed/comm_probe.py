"""How long a step's communication takes: the step's collectives, replayed alone.

Inside a distributed forward the collectives (a pipeline's ``recv`` / ``send`` / ``all_gather``, tensor
parallel's ``all_sum`` after each sharded-to-all projection) run in one evaluated graph with the layers'
compute, and MLX times nothing inside a graph. So every ``PROBE_EVERY`` steps each rank replays the
collectives of the previous step's forwards, on zeros of the same shapes and in the same order, and times
that alone: the link's transfer and latency for that step, without the waiting a pipeline's stages add
(that is in the step time). Every rank replays at the same step (the step counter is rank 0's plan, which
every rank follows), so the replayed collectives pair up as the forward's do.

``forward_s`` is the same step's forwards as evaluated (``runner/forward``), so ``comm_s / forward_s`` is
the share of a step the link costs.
"""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn

PROBE_EVERY = 16  # steps between two replays (a replay costs the step's communication again)


def _sharded_to_all(net) -> list[int]:
    """Output widths of tensor parallel's sharded-to-all projections: one ``all_sum`` each per forward."""
    kinds = (nn.ShardedToAllLinear, nn.QuantizedShardedToAllLinear)
    return [int(m.weight.shape[0]) for _, m in net.named_modules() if isinstance(m, kinds)]


class CommProbe:
    """Records each forward's (rows, positions) and evaluation time; replays one step's collectives."""

    def __init__(self, dist, net, hidden: int, dtype):
        self.dist = dist
        self.hidden, self.dtype = hidden, dtype
        self.sums = _sharded_to_all(net) if dist.mode == "tensor" else []
        self.step_shapes: list[tuple[int, int]] = []
        self.step_forward_s = 0.0
        self.probes = 0
        self.comm_s = 0.0  # replayed communication, summed over the probed steps
        self.forward_s = 0.0  # the probed steps' forwards, summed
        self.last: dict | None = None
        self.at_load_s: dict = {}

    def saw(self, shape, seconds: float) -> None:
        """A forward of this step: its output's leading (rows, positions) and its evaluation time."""
        self.step_shapes.append((int(shape[0]), int(shape[1]) if len(shape) > 2 else 1))
        self.step_forward_s += seconds

    def at_step(self, step: int) -> None:
        """Called on every rank before step ``step``'s forwards: replays the last step's collectives on probe
        steps, then starts recording this one."""
        shapes, forward_s = self.step_shapes, self.step_forward_s
        self.step_shapes, self.step_forward_s = [], 0.0
        if step % PROBE_EVERY or not shapes:
            return
        comm = self.replay(shapes)
        self.probes += 1
        self.comm_s += comm
        self.forward_s += forward_s
        self.last = {"step": step - 1, "forwards": len(shapes), "comm_s": round(comm, 6),
                     "forward_s": round(forward_s, 6)}

    def at_load(self) -> None:
        """On every rank at load: one decode row's and one 128-token prefill chunk's collectives (best of 3)."""
        self.replay([(1, 1)])  # the first use of a link may set it up
        self.at_load_s = {"decode_1_row_s": round(min(self.replay([(1, 1)]) for _ in range(3)), 6),
                          "prefill_128_tokens_s": round(min(self.replay([(1, 128)]) for _ in range(3)), 6)}

    def replay(self, shapes: list[tuple[int, int]]) -> float:
        t0 = time.perf_counter()
        for rows, positions in shapes:
            mx.eval(self._collectives(rows, positions))
        return time.perf_counter() - t0

    def _collectives(self, rows: int, positions: int) -> mx.array:
        d, group = self.dist, self.dist.group
        if d.mode == "tensor":
            out = mx.zeros((rows, positions, 1), dtype=self.dtype)
            for width in self.sums or [self.hidden]:  # chained: one after another, as the layers run them
                x = mx.zeros((rows, positions, width), dtype=self.dtype) + out[..., :1]
                out = mx.distributed.all_sum(x, group=group)
            return out
        h = mx.zeros((rows, positions, self.hidden), dtype=self.dtype)
        recv_from, send_to = d.shard.get("recv_from"), d.shard.get("send_to")
        if recv_from is not None:
            h = mx.distributed.recv_like(h, recv_from, group=group)
        if send_to is not None:
            h = mx.distributed.send(h, send_to, group=group)
        return mx.distributed.all_gather(h, group=group)

    def describe(self) -> dict:
        return {"probed_steps": self.probes, "every": PROBE_EVERY,
                "comm_s_per_step": round(self.comm_s / self.probes, 6) if self.probes else None,
                "forward_s_per_step": round(self.forward_s / self.probes, 6) if self.probes else None,
                "comm_share": round(self.comm_s / self.forward_s, 4) if self.forward_s > 0 else None,
                "last": self.last, "at_load": self.at_load_s}
