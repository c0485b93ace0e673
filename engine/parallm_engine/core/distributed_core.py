"""One scheduler across the ranks of a distributed engine: rank 0 decides, every rank steps in step.

Every rank runs the same engine (scheduler, KV cache manager, runner) on its shard of the model. Rank 0 alone
has callers; the other ranks hold a mirror of its requests. Before each step's forwards, rank 0 sends one
message (``LeaderSync.send_plan``): the commands its engine thread took since the last step (requests
added, aborted, the prefix cache cleared), the step's plan by sequence keys (``StepPlan.message``) and a
digest of every sequence's tokens so far. A follower (``run_follower``) applies the commands, plans its own
step from the same state and checks it against rank 0's, then runs it: the same forwards, so the
collectives inside the model (a pipeline's sends, tensor parallel's sums) pair up, and the same pages of its
own layers / heads for the same page tables. The scheduler is deterministic given its commands once the
clock is out of it (``Engine`` sets no step-time target, no disk tier, no sessions in this mode); a plan or
a token that differs anyway stops the group with ``RankLostError`` instead of running wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
import random
import sys
import threading
import time

from parallm_engine.errors import DistributedError, RankLostError
from parallm_engine.core.request import Channel, Request

logger = logging.getLogger("parallm_engine")

# Which mirrored maintenance calls a follower knows how to repeat (``Engine.run_mirrored_here``).
MIRRORED_CALLS = ("clear_prefix_cache", "release_session")
MEMORY_EVERY = 32  # steps between two gathers of every rank's memory (``DistributedGroup.gather_memory``)


def gather_memory(dist, sched, weights: int) -> None:
    import mlx.core as mx

    dist.gather_memory(weights, sched.kv_bytes_held(), mx.get_active_memory())


# -- requests as a message --------------------------------------------------------------------------------
def _group_key(group, request_id: str):
    """A request's admission group as a value equal on every rank (the default group is its own id)."""
    if group == request_id or isinstance(group, (str, int)):
        return group
    return ("group", id(group))  # alive while any of its requests is: the scheduler holds it


def describe_request(req: Request) -> dict:
    """What a follower needs to hold the same request (typed error for what cannot cross)."""
    if req.vision is not None:
        raise DistributedError("image prompts are not supported by the distributed mode")
    if req.adapter is not None:
        raise DistributedError("LoRA adapters are not supported by the distributed mode")
    grammar = req.grammar
    if grammar is not None:
        grammar = ("llguidance", grammar.source) if hasattr(grammar, "source") else ("object", grammar)
    return {"id": req.id, "prompt_ids": list(req.prompt_ids), "params": req.params, "grammar": grammar,
            "tools": req.tools, "priority": req.priority, "group": _group_key(req.group, req.id),
            "session": req.session, "program": req.program, "cycle_guard": req.cycle_guard, "arrival": req.arrival,
            "embedding": req.embedding}


def rebuild_request(d: dict, tokenizer, vocab_size: int) -> Request:
    """The follower's copy of a request rank 0 described; what it delivers goes nowhere."""
    from parallm_engine.sampling.constrained import compile_grammar

    grammar = d["grammar"]
    if grammar is not None:
        kind, value = grammar
        grammar = compile_grammar(tokenizer, vocab_size, value) if kind == "llguidance" else value
    req = Request(d["prompt_ids"], d["params"], _Nowhere(), grammar=grammar, request_id=d["id"],
                  priority=d["priority"], tools=d["tools"], group=d["group"])
    req.session = d["session"]
    req.program = d["program"]
    req.cycle_guard = d["cycle_guard"]
    req.arrival = d["arrival"]  # waiting order is by arrival: rank 0's clock, not this one's
    req.embedding = d["embedding"]
    return req


class _Nowhere(Channel):
    """A follower's requests have no caller: their deltas are dropped."""

    def __init__(self):
        self.loop = None

    def put(self, item) -> None:
        pass


# -- what every rank checks ------------------------------------------------------------------------------
def plan_key(plan) -> dict:
    """The plan without its clock readings (``started``, ``plan_s``, ``deadline`` differ by rank)."""
    msg = plan.message()
    for k in ("started", "plan_s", "deadline"):
        msg.pop(k, None)
    return msg


def token_digest(sched) -> str:
    """Every live sequence's tokens so far, as a short hash: equal on every rank while they agree."""
    h = hashlib.blake2b(digest_size=8)
    for s in list(sched.running) + list(sched.prefilling) + list(sched.waiting):
        h.update(f"{s.request.id}/{s.index}:{len(s.output_ids)}:{s.output_ids[-1] if s.output_ids else -1};".encode())
    return h.hexdigest()


# -- rank 0 ---------------------------------------------------------------------------------------------
class LeaderSync:
    """Rank 0's side: the commands to mirror, sent with each step's plan; the group's end."""

    def __init__(self, dist, step_timeout_s: float, weights: int):
        self.dist = dist
        self.weights = weights
        self.step_timeout_s = step_timeout_s
        self.commands: list = []
        self.steps = 0
        self.step_started: float | None = None  # monotonic() while a step runs (the watchdog reads it)
        self.stopped = False

    def record_add(self, req) -> None:
        """A request to mirror; one that cannot cross (typed error) is refused alone, before the scheduler.
        An unseeded sampled request gets a seed of rank 0's drawing: its draws then come from its own key chain
        on every rank (the global key is per thread in MLX, and the ranks' engine threads differ)."""
        if req.params.seed is None and req.params.temperature > 0:
            req.params = dataclasses.replace(req.params, seed=random.getrandbits(31))
        desc = describe_request(req)
        try:
            pickle.dumps(desc, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise DistributedError(f"this request cannot be sent to the other ranks: {exc!r}") from exc
        self.commands.append(("add", desc))

    def record(self, cmd: str, arg) -> None:
        self.commands.append((cmd, arg))

    def park(self) -> None:
        """Rank 0 is idle: the other ranks wait on their idle link (no polling) until the next step."""
        link = self.dist.idle
        if link is None or link.parked:
            return
        self.dist.broadcast({"park": True, "commands": self.commands})
        self.commands = []
        link.parked = True

    def _wake(self) -> None:
        if self.dist.idle is not None:
            self.dist.idle.wake()

    def send_plan(self, sched, plan) -> None:
        self._wake()
        msg = {"commands": self.commands, "plan": plan_key(plan), "digest": token_digest(sched), "step": self.steps}
        self.commands = []
        self.steps += 1
        self.dist.broadcast(msg)
        if msg["step"] % MEMORY_EVERY == 0:
            gather_memory(self.dist, sched, self.weights)
        if self.dist.probe is not None:
            self.dist.probe.at_step(msg["step"])

    def stop(self, reason: str) -> None:
        """Shutdown: the followers leave their loops (best effort: a lost group cannot hear it)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self._wake()
            self.dist.broadcast({"stop": reason, "commands": self.commands})
        except Exception:  # noqa: BLE001
            logger.warning("could not tell the other ranks to stop", exc_info=True)


def lost_rank_error(dist, exc: BaseException | None = None, hung_s: float | None = None) -> RankLostError:
    """The typed error every request gets when the group breaks; names the rank where one can tell."""
    other = 1 if dist.size == 2 else None
    who = f"rank {other}" if other is not None else f"one of ranks 1-{dist.size - 1}"
    if hung_s is not None:
        why = f"{who} did not answer for {hung_s:.0f} s (hung, or its link is down)"
    else:
        why = f"{who} was lost ({exc!r})" if exc is not None else f"{who} was lost"
    return RankLostError(f"the distributed engine stopped: {why}; restart the group (mlx.launch)", rank=other)


class StepWatchdog(threading.Thread):
    """Rank 0: a step whose collectives wait longer than ``timeout_s`` (a rank hung or its link dropped
    without a reset) ends every request with ``RankLostError`` from this thread; the engine thread stays
    blocked in MLX, so the engine is dead from then on (the server answers 503)."""

    def __init__(self, core, sync: LeaderSync):
        super().__init__(name="parallm-step-watchdog", daemon=True)
        self.core, self.sync = core, sync

    def run(self) -> None:
        while not self.core.stopping and self.core.dead is None:
            started = self.sync.step_started
            if started is not None and time.monotonic() - started > self.sync.step_timeout_s:
                self.core.group_lost(lost_rank_error(self.sync.dist, hung_s=time.monotonic() - started))
                return
            time.sleep(min(1.0, self.sync.step_timeout_s / 10))


# -- the other ranks ------------------------------------------------------------------------------------
def run_follower(engine, sched) -> None:
    """A follower's engine loop, on the calling thread, until rank 0 stops the group; then the process ends
    (a follower has no caller to return to). A step that fails or disagrees with rank 0 ends it too (exit
    status 1): ``mlx.launch`` then stops the group and rank 0's requests end with ``RankLostError``."""
    import mlx.core as mx

    dist = engine.dist
    weights = engine.weight_bytes
    tokenizer, vocab = engine.tokenizer, engine.model_info.vocab_size
    status = 0
    try:
        while True:
            msg = dist.broadcast()
            for cmd, arg in msg.get("commands", ()):
                if cmd == "add":
                    req = rebuild_request(arg, tokenizer, vocab)
                    try:
                        sched.add(req)
                    except Exception as exc:  # as rank 0: the request fails alone
                        sched.reject(req, exc)
                elif cmd == "abort":
                    sched.abort(arg)
                elif cmd == "call":
                    name, args = arg
                    try:
                        engine.run_mirrored_here(name, *args)
                    except Exception:  # as on rank 0, where its caller got the error: the group goes on
                        logger.warning("rank %d: mirrored %s failed", dist.rank, name, exc_info=True)
            if "stop" in msg:
                logger.info("rank %d: rank 0 stopped the group (%s)", dist.rank, msg["stop"])
                break
            if "park" in msg:  # rank 0 is idle: wait on the idle link, not in a polling collective
                if not dist.idle.wait():
                    logger.critical("rank %d: rank 0's connection closed while idle; leaving", dist.rank)
                    status = 1
                    break
                continue

            def check(plan, msg=msg):
                mine, digest = plan_key(plan), token_digest(sched)
                if mine != msg["plan"] or digest != msg["digest"]:
                    raise DistributedError(f"rank {dist.rank} diverged from rank 0 at step {msg['step']} "
                                           f"(plan equal: {mine == msg['plan']}, tokens equal: {digest == msg['digest']})")
                if msg["step"] % MEMORY_EVERY == 0:
                    gather_memory(dist, sched, weights)
                if dist.probe is not None:
                    dist.probe.at_step(msg["step"])

            sched.step(on_plan=check)
    except Exception:
        logger.critical("rank %d: the engine loop failed; leaving the group", dist.rank, exc_info=True)
        status = 1
    finally:
        try:
            mx.synchronize()
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # MLX's distributed state and the engine thread's streams: no interpreter teardown


# -- joining ----------------------------------------------------------------------------------------------
def join_group(mode: str, *, backend: str | None, speculative, adapters, session_ttl, kv_bits):
    """Join ``mlx.launch``'s group for ``Engine(distributed=mode)``. What this mode does not support is refused
    here, typed, before a weight is read."""
    from parallm_engine.distributed.group import init_group

    if speculative is not None and getattr(speculative, "enabled", True):
        raise DistributedError("speculative decoding is not supported by the distributed mode")
    if adapters:
        raise DistributedError("LoRA adapters are not supported by the distributed mode")
    if session_ttl:
        raise DistributedError("sessions (session_ttl) are not supported by the distributed mode: their pins "
                               "expire by each rank's clock")
    if kv_bits:
        raise DistributedError("a quantized KV cache (kv_bits) is not supported by the distributed mode")
    if backend == "cpu-native":
        raise DistributedError("the native CPU kernels do not run distributed: use backend='cpu-mlx' (the default "
                               "in this mode), 'metal' or 'cuda'", supported=["cpu-mlx", "metal", "cuda"])
    return init_group(mode)


def cpu_backend_for(dist, chosen):
    """The CPU's pure-MLX path where the device's default would be the native kernels; ranks that share one
    machine's CPU share its cores (each BLAS call of a rank on as many threads as its share: several ranks
    each running every core's worth of BLAS threads, and a waiting rank's collective polling, would take
    turns on the same cores). A collective: every rank calls it."""
    import socket

    from parallm_engine.runner.backend import choose_backend, set_blas_threads, usable_cores

    backend = choose_backend("cpu-mlx") if chosen.name == "cpu-native" else chosen
    me = int.from_bytes(hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest(), "little")
    local = sum(1 for row in dist.gather_ints([me]) if row[0] == me)
    if backend.device == "cpu" and local > 1:
        threads = max(1, usable_cores() // local)
        if set_blas_threads(threads):
            logger.info("rank %d: %d ranks share this machine's CPU: BLAS on %d thread(s)", dist.rank, local, threads)
    return backend


def agree_on_settings(dist, engine) -> None:
    """Every rank runs the same model files with the same scheduler settings; unseeded sampling draws from
    one seed. The KV budgets are agreed in tokens (what the tightest rank holds) and each rank's are those
    tokens at its own KV bytes per token: a rank with more layers holds more bytes per token, and every
    budget decision (admission, preemption, eviction) compares its bytes with its own budget, so the ranks
    decide alike however the layers are split."""
    import mlx.core as mx

    info, cfg = engine.model_info, engine.config
    index = info.path / "model.safetensors.index.json"
    if index.exists():  # a sharded checkpoint: its index (a pipeline rank may hold only its own files)
        files = hashlib.sha256(index.read_bytes()).hexdigest()
    else:
        files = sorted((p.name, p.stat().st_size) for p in info.path.glob("*.safetensors"))
    dist.agree("the model's files", (info.name, sorted(info.config.items(), key=str), files))
    per_token = max(1, info.kv_bytes_per_token())
    ws = cfg.working_set_bytes
    rows = dist.gather_ints([cfg.kv_budget_bytes // per_token, cfg.radix_budget_bytes // per_token,
                             -1 if ws is None else ws // per_token])
    cfg.kv_budget_bytes = min(r[0] for r in rows) * per_token
    cfg.radix_budget_bytes = min(r[1] for r in rows) * per_token
    cfg.working_set_bytes = None if ws is None else max(0, min(r[2] for r in rows)) * per_token
    dist.agree("the engine's settings", (cfg.max_batch_size, cfg.prefill_chunk, cfg.prefill_budget,
                                         cfg.kv_budget_bytes // per_token, cfg.enable_prefix_cache,
                                         cfg.batch_invariant, cfg.fuse_prefill, cfg.decode_working_set,
                                         cfg.decode_lanes, cfg.micro_batches, engine.backend.name))
    mx.random.seed(dist.seed())
    dist.gather_memory(engine.weight_bytes, 0, mx.get_active_memory())
    from parallm_engine.distributed.group import IdleLink

    try:
        link = IdleLink(dist)
    except OSError:  # every rank reaches this point: a failure here is rank 0's (no listening socket)
        logger.warning("the other ranks will wait for work in the group's collectives", exc_info=True)
        link = None
    dist.idle = link if link is not None and link.usable else None
