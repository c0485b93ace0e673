"""The engine: one thread owns all MLX work; callers submit from any thread or event loop.

Public surface::

    eng = get_engine()                       # the shared engine for the default model
    eng.generate(["a", "b"], max_tokens=32)  # list in, list of GenerationResult out (all in flight at once)
    await eng.agenerate([...])
    for d in eng.stream("prompt"): ...       # StreamDelta; closing the iterator aborts the request
    async for d in eng.astream("prompt"): ...
    eng.chat(messages, tools=...) / achat / chat_stream / achat_stream
    eng.stats()
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import os
import weakref
from typing import Any

from parallm_engine import settings
from parallm_engine.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    InvalidRequestError,
)
from parallm_engine.sampling.constrained import compile_constraint
from parallm_engine.core.tracing import request_span
from parallm_engine.core.request import Channel, Request, RequestHandle
from parallm_engine.sampling.sampler import SamplingParams
from parallm_engine.sampling.sampling_params import apply_model_defaults
from parallm_engine.sampling.spec_config import parse_speculative
from parallm_engine.kv.kv_quant import resolve_kv_bits
from parallm_engine.kv.memory_budget import apply_mlx_limits, mlx_limits, working_set_bytes
from parallm_engine.embed.embedding_api import EmbeddingAPI
from parallm_engine.embed.rerank_api import RerankAPI
from parallm_engine.core.engine_api import EngineConvenienceAPI, Prompt
from parallm_engine.core.engine_base import EngineBase
from parallm_engine.core.engine_core import EngineCore
from parallm_engine.runner import lora
from parallm_engine.models.lora_adapters import DEFAULT_MAX_ADAPTERS, AdapterRegistry, linear_dims
from parallm_engine.core.scheduler import Scheduler, SchedulerConfig
from parallm_engine.core.stats import EngineStats
from parallm_engine.core.validation import check_text
from parallm_engine.vision.vlm import VisionPrompt
from parallm_engine.vision.worker import note_abort, submit_after_encoding

logger = logging.getLogger("parallm_engine")

_live_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    # Stop engine threads before the interpreter tears down MLX; a daemon thread still inside an
    # MLX call at exit aborts the process ("terminate called without an active exception").
    for eng in list(_live_engines):
        eng.shutdown(timeout=30.0)


#: Above this many bytes of weights, a decode step is bound by reading them: every CPU lane streams all of
#: them, so parallel lanes slow it down. A small model decodes faster on two lanes, a multi-GB one on one
#: (docs/benchmarks-archive.md, "Real family shapes, the memory workload, plots").
LANE_WEIGHT_LIMIT = 1536 << 20


def _lanes_for(backend, model) -> int:
    """The backend's decode lanes, or one when the model's weights are too large to stream once per lane."""
    if backend.decode_lanes <= 1 or settings.decode_lanes() is not None:
        return backend.decode_lanes
    return 1 if _weight_bytes(model) > LANE_WEIGHT_LIMIT else backend.decode_lanes


def _disk_tier(kv_disk, enable_prefix_cache: bool, info, backend, weights_dtype, dtype, batch_invariant):
    """The disk tier's settings for this engine (None: off), keyed by everything that changes its KV's bits."""
    import mlx.core as mx

    from parallm_engine.kv import disk_tier

    root = disk_tier.default_root()
    cap = disk_tier.resolve_cap(kv_disk, root)
    if not cap or not enable_prefix_cache:
        return None
    try:
        files = disk_tier.model_files_fingerprint(info.path)
    except OSError:
        logger.warning("the prefix cache's disk tier is off: could not read %s", info.path, exc_info=True)
        return None
    key = disk_tier.kv_fingerprint(files["files"], backend=backend.name, device=backend.device,
                                   weights=weights_dtype, dtype=dtype, batch_invariant=batch_invariant,
                                   mlx=mx.__version__, engine=_engine_version())
    return disk_tier.DiskTierConfig(root, cap, key, about={"model": info.name, "path": str(info.path),
                                                          "backend": backend.name})


def _engine_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("parallm-engine")
    except PackageNotFoundError:
        return "dev"


def _weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


class Engine(EngineConvenienceAPI, EmbeddingAPI, RerankAPI, EngineBase):
    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str | None = None,
        weights_dtype: str | None = None,
        max_batch_size: int = 64,
        max_queue: int = 1024,
        prefill_chunk: int | None = None,
        prefill_budget: int | None = None,
        kv_memory: float | int | None = None,
        kv_budget_bytes: int | None = None,
        kv_bits: int | None = None,
        prefix_cache_bytes: int | None = None,
        enable_prefix_cache: bool = True,
        decode_lanes: int | None = None,
        backend: str | None = None,
        speculative: Any = None,
        adapters: dict[str, str | os.PathLike] | None = None,
        max_adapters: int = DEFAULT_MAX_ADAPTERS,
        batch_invariant: bool | None = None,
        fuse_prefill: bool | None = None,
        compile_decode: bool | None = None,
        decode_working_set: bool | None = None,
        kv_disk: int | str | None = None,
        session_ttl: float | None = None,
        kv_events: str | dict | None = None,
        distributed: str | None = None,
        distributed_timeout: float = 90.0,
    ):
        """``backend``: ``"cpu-native"``, ``"cpu-mlx"`` (MLX ops only, the path Metal and CUDA take),
        ``"metal"`` or ``"cuda"``; None picks the device's (``PARALLM_BACKEND`` overrides).
        ``prefill_chunk`` / ``prefill_budget``: the most prompt tokens in one prefill forward / in one step
        (None: the backend's, ``Backend.prefill_chunk``: 512 / 2048, 4096 / 16384 on CUDA).
        ``kv_memory``: the KV budget the running sequences and the prefix cache share, as a fraction of
        what the device offers or in bytes (default a quarter; ``parallm info`` shows it;
        ``kv_budget_bytes`` is the same in bytes). ``prefix_cache_bytes`` caps the prefix cache within it.
        ``kv_bits``: store the KV cache at 8 or 4 bits (``PARALLM_KV_BITS``; None: the model's dtype), about
        3.6x / 6.4x less KV memory for float32 KV at a small accuracy cost (``kv_quant.py``).
        ``speculative``: the default for requests that do not set their own (``spec_config``), e.g.
        ``{"method": "ngram", "num_tokens": 4}``. ``weights_dtype``: ``"float32"`` (default) or
        ``"bfloat16"`` weight storage on the CPU, or ``"bfloat16-matmul"`` (bfloat16 weights and matmul
        inputs, float32 sums; AVX512_BF16's kernel where the CPU has it) (``PARALLM_WEIGHTS_DTYPE``; Metal
        and CUDA keep the model's dtype; see ``weights_dtype.py``). ``adapters``: LoRA adapters by name
        (``{"sql": "/path/to/adapter_dir"}``; mlx-lm's or PEFT's format), loaded and checked now; a request
        picks one with ``adapter=``, which also takes an adapter directory or cached HF repo id (loaded on
        first use). ``max_adapters`` of them stay loaded (LRU) and resident in the batch's stacks
        (``lora.py``, ``docs/lora.md``). ``batch_invariant`` (CPU; default on, ``PARALLM_BATCH_INVARIANT=0``
        turns it off): pad the BLAS's small products so a row's bits do not depend on the rows beside it
        (``batch_invariance.py``; ``Engine.backend.batch_invariance`` says whether it holds for this BLAS).
        Switches for the step's execution (None: the ``PARALLM_*`` variable of the same name, else the
        default): ``fuse_prefill`` (default on) computes a long prompt's chunk in the decode step's forward
        (``kv/fused_step.py``); ``compile_decode`` (default off, experimental) runs a plain decode step as one
        compiled graph (``runner/compiled_decode.py``); ``decode_working_set`` (default on) keeps each lane's
        decode working set between plain steps (``kv/decode_working_set.py``). None changes the tokens.
        ``kv_disk``: the prefix cache's disk tier (``kv/disk_tier.py``): prefixes the cache lets go of, and all
        it holds at shutdown, are kept under the ParaLLM cache directory and read back by later prompts, in
        this process or the next. Its size cap in bytes or as "8GiB"; 0 turns it off; None:
        ``PARALLM_KV_DISK``, else 16 GiB or a tenth of the disk's free space. ``parallm cache`` lists and
        clears it. ``session_ttl``: seconds a request's context stays pinned in the prefix cache after its
        turn when it names a ``session`` (``kv/session_pins.py``). Default 30 (a tool call's time); 0 turns
        sessions off; the distributed mode runs without them (docs/memory.md, "Sessions"). ``kv_events``: publish what the
        prefix cache holds as vLLM-format KV events on a ZMQ endpoint (``"tcp://*:5557"``, or a dict with
        ``endpoint``, ``replay_endpoint``, ``topic``, ``block_size``: ``kv/kv_events.py``) for prefix-aware
        routers (llm-d, Dynamo); None: off. ``distributed``: ``"pipeline"`` or ``"tensor"``, one model over the
        ranks of ``mlx.launch`` (``docs/distributed.md``): rank 0 returns the engine, the other ranks run its
        steps until rank 0 shuts down and then exit; a rank that dies or hangs for ``distributed_timeout``
        seconds ends every request with ``RankLostError``."""
        from parallm_engine.runner.backend import choose_backend
        from parallm_engine.models.loader import load_model

        for name, value in (("max_batch_size", max_batch_size), ("max_queue", max_queue),
                            ("prefill_chunk", 1 if prefill_chunk is None else prefill_chunk),
                            ("prefill_budget", 1 if prefill_budget is None else prefill_budget),
                            ("decode_lanes", 1 if decode_lanes is None else decode_lanes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)
        switches = {"fuse_prefill": fuse_prefill, "compile_decode": compile_decode,
                    "decode_working_set": decode_working_set}
        for name, value in switches.items():
            if value is not None and not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be True, False or None, got {value!r}", param=name)
        if session_ttl is not None and (isinstance(session_ttl, bool) or not isinstance(session_ttl, (int, float))
                                        or not 0 <= session_ttl < float("inf")):
            raise InvalidRequestError(f"session_ttl must be a number of seconds >= 0, got {session_ttl!r}",
                                      param="session_ttl")
        from parallm_engine.kv.kv_events import KVEventsConfig

        kv_events = KVEventsConfig.parse(kv_events)
        speculative = parse_speculative(speculative)
        kv_bits = resolve_kv_bits(kv_bits)
        #: The ranks this engine runs on (``distributed/group.py``); None: this process alone.
        self.dist = None
        if distributed is not None:
            from parallm_engine.core.distributed_core import join_group

            self.dist = join_group(distributed, backend=backend, speculative=speculative, adapters=adapters,
                                   session_ttl=session_ttl, kv_bits=kv_bits)
        try:
            self.backend = choose_backend(backend)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="backend") from exc
        if self.dist is not None:
            from parallm_engine.core.distributed_core import cpu_backend_for

            self.backend = cpu_backend_for(self.dist, self.backend)
        from parallm_engine.runner.weights_dtype import resolve_weights_dtype

        weights = resolve_weights_dtype(weights_dtype, self.backend.device)
        shard = None
        if self.dist is not None:
            from parallm_engine.distributed.sharding import ShardPlan

            shard = ShardPlan(self.dist, self.backend.memory_bytes)

        self.model, self.tokenizer, self.model_info = load_model(model, dtype=dtype, weights_dtype=weights,
                                                                 shard=shard)
        #: The weight storage in effect ("float32", "bfloat16", "bfloat16-matmul"; None: the model's own dtype).
        self.weights_dtype = weights if dtype in (None, "float32") else None
        if self.weights_dtype == "bfloat16":
            self.backend.dtype = "bfloat16 weights, float32 activations and KV"
        elif self.weights_dtype == "bfloat16-matmul":
            self.backend.dtype = ("bfloat16 weights and matmul inputs (float32 sums), float32 activations and KV"
                                  + ("; AVX512_BF16 kernel" if self.backend.name == "cpu-native" and _bf16_dot_kernel() else ""))
        budget = kv_budget_bytes or self.backend.kv_budget(kv_memory)
        weight_bytes = _weight_bytes(self.model)
        self.weight_bytes = weight_bytes  # what this process holds (a distributed rank: its shard)
        self.mlx_limits = apply_mlx_limits(mlx_limits(self.backend.device, self.backend.memory_bytes, budget,
                                                      weight_bytes))
        self.config = SchedulerConfig(
            max_batch_size=max_batch_size,
            prefill_chunk=self.backend.prefill_chunk if prefill_chunk is None else prefill_chunk,
            prefill_budget=self.backend.prefill_budget if prefill_budget is None else prefill_budget,
            kv_budget_bytes=budget,
            working_set_bytes=working_set_bytes(self.backend.memory_bytes, budget, weight_bytes),
            radix_budget_bytes=min(budget, prefix_cache_bytes) if prefix_cache_bytes is not None else budget,
            enable_prefix_cache=enable_prefix_cache,
            decode_lanes=decode_lanes or _lanes_for(self.backend, self.model),
            cpu_kernels=self.backend.cpu_kernels,
            batch_invariant=self.backend.device == "cpu" and (
                settings.batch_invariant() if batch_invariant is None else bool(batch_invariant)),
            speculative=speculative,
            kv_bits=kv_bits,
            **{name: value for name, value in switches.items() if value is not None},
            **({"session_ttl_s": float(session_ttl)} if session_ttl is not None else {}),
            kv_events=kv_events,
        )
        self.config.kv_disk = _disk_tier(kv_disk, enable_prefix_cache, self.model_info, self.backend,
                                         self.weights_dtype, dtype, self.config.batch_invariant)
        if self.dist is not None:
            self._distributed_settings()
        self._stats = EngineStats()
        if getattr(self.model, "vision", None) is not None:  # image features share the prefix cache's budget
            self.model.vision.budget_bytes = max(1 << 20, self.config.radix_budget_bytes // 4)
        self._scheduler = Scheduler(self.model, self.tokenizer, self.model_info, self.config, self._stats)
        if speculative is not None and speculative.enabled and self._scheduler.speculator is None:
            raise InvalidRequestError(self._scheduler.no_speculation, param="speculative")
        self._check_draft(speculative)
        self.adapters = AdapterRegistry(linear_dims(self.model), max_adapters)
        for name, path in (adapters or {}).items():
            self.adapters.register(name, path)
        if adapters:
            lora.attach(self.model, max_adapters)
        if self.backend.name == "cpu-native" and not self._scheduler.native_kernels:
            self.backend.name = "cpu-mlx"  # the native kernels could not be built: MLX-op kernels
        self.backend.decode_lanes = self.config.decode_lanes
        self.backend.batch_invariance = _batch_invariance_line(self._scheduler.runner.batch_invariance,
                                                               self.backend.device)
        logger.info("%s; model layout %s", self.backend.summary(), self._scheduler.layout)
        sync = None
        if self.dist is not None:
            from parallm_engine.core.distributed_core import LeaderSync, run_follower

            if not self.dist.leader:
                run_follower(self, self._scheduler)  # the other ranks step with rank 0 until it stops; then the process ends
            sync = LeaderSync(self.dist, distributed_timeout, weight_bytes)
        #: The engine thread and the one way onto it (enqueue, abort, reject, call between steps).
        self.core = EngineCore(self._scheduler, self._stats, self.model, max_queue, sync=sync)
        _live_engines.add(self)

    def _distributed_settings(self) -> None:
        """Out of the scheduler goes everything that differs by rank: the clock (no step-time target: a fixed
        prefill budget per step), the disk tier, a second decode lane, compiled steps; KV events come from
        rank 0 only. Then the ranks agree on the rest (``agree_on_settings``)."""
        from parallm_engine.core.distributed_core import agree_on_settings

        cfg = self.config
        cfg.step_time_target_s = 0.0
        cfg.kv_disk = None
        cfg.session_ttl_s = 0.0  # pins would expire by each rank's own clock
        # One decode lane, or for a pipeline one per stage, its micro-batches (runner/forward.micro_batched)
        cfg.micro_batches = self.dist.mode == "pipeline" and settings.pipeline_micro_batches()
        cfg.decode_lanes = self.dist.size if cfg.micro_batches else 1
        cfg.compile_decode = False
        if not self.dist.leader:
            cfg.kv_events = None
        agree_on_settings(self.dist, self)
        self.model.distributed_ranks = self.dist.size  # its forwards are evaluated at once (runner/forward.py)
        import mlx.core as mx

        from parallm_engine.distributed.comm_probe import CommProbe

        text = self.model_info.config.get("text_config", self.model_info.config)
        hidden = text.get("hidden_size") or text.get("d_model") or text.get("n_embd")
        if isinstance(hidden, int):  # (every family the modes split has it)
            dtype = getattr(mx, str(self.model_info.dtype), mx.float32)
            self.dist.probe = self.model.comm_probe = CommProbe(self.dist, self.model, hidden, dtype)
            self.dist.probe.at_load()

    # -- properties -----------------------------------------------------------------------------
    @property
    def sampling_defaults(self) -> dict:
        """What a request samples with for each of temperature / top_p / top_k / min_p /
        repetition_penalty it leaves unset: the model's recommendation
        (``model_info.sampling_defaults_source`` says where it was found). Fields not listed here
        fall back to :class:`SamplingParams`' defaults (OpenAI's)."""
        return dict(self.model_info.sampling_defaults)

    @property
    def max_queue(self) -> int:
        """Requests in flight at most (queued, prefilling or decoding); more get QueueFullError. May be
        changed while the engine runs."""
        return self.core.max_queue

    @max_queue.setter
    def max_queue(self, value: int) -> None:
        self.core.max_queue = value

    @property
    def _dead(self) -> BaseException | None:
        """None while the engine thread runs (``EngineBase.is_alive``)."""
        return self.core.dead

    @property
    def running_count(self) -> int:
        """Requests in flight (queued, prefilling or decoding)."""
        return self._stats.in_flight

    # -- submission -----------------------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        response_format: dict | None = None,
        tools: list[dict] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        request_id: str | None = None,
        priority: int = 0,
        group=None,
        adapter: str | os.PathLike | None = None,
        session: str | None = None,
        program: str | None = None,
        **sampling: Any,
    ) -> RequestHandle:
        """Queue one request; returns a handle to iterate (sync, or async when ``loop`` is given).

        ``priority``: smaller runs first and is preempted last when memory runs short (vLLM's
        convention; default 0, FIFO among equals). ``group`` (any hashable; default: the request
        itself): admission takes turns across groups, so one caller's thousand prompts do not lock
        out another's two (``generate``/``agenerate`` put one call's prompts in one group).

        ``response_format`` (OpenAI shape, or ``{"type": "regex", "regex": ...}``) constrains decoding
        with a grammar; so do ``tools`` (OpenAI tool dicts): "required" / named ``tool_choice`` forces a
        valid call, "auto" (the default) allows text or valid calls, "none" text only (see
        :func:`constrained.tool_call_grammar`). With ``tools`` the result carries parsed ``tool_calls``.
        Rendering tools into the prompt is the chat template's job: use :meth:`chat` or
        :meth:`apply_chat_template`.

        Sampling settings left unset (absent or None) among temperature / top_p / top_k / min_p /
        repetition_penalty / max_tokens take the model's recommendation (:attr:`sampling_defaults`); explicit
        values always win. A request that sets no ``max_tokens`` is also ended (``finish_reason="length"``)
        when its output starts cycling through one block of tokens (``repetition_guard.py``). A ready-made
        ``params=SamplingParams(...)`` is used as it is. The effective settings are on the handle:
        ``handle.request.params``.

        ``adapter``: the LoRA adapter the request runs under (a name given in ``adapters=`` or
        :meth:`load_adapter`, an adapter directory, or a cached HF repo id); None: the base model. It
        shares the batch with every other request (``lora.py``); an unknown one raises
        :class:`AdapterNotFoundError`, one that does not fit the model :class:`AdapterLoadError`.

        ``session``: the conversation this request is a turn of (an agent, a LangGraph thread): when it
        finishes, its context stays pinned in the prefix cache for ``session_ttl`` seconds, so the next turn
        finds it however busy the engine is (``kv/session_pins.py``); :meth:`release_session` lets it go.
        ``program``: the agent run it is a call of (default: its ``session``): admission orders calls by their
        programs (``core/admission_order.py``) and ``stats()["programs"]`` reports each (``core/programs.py``).
        """
        if self.core.dead is not None:
            raise EngineDeadError(f"engine is not running: {self.core.dead}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {type(priority).__name__}", param="priority")
        for name, value in (("session", session), ("program", program)):
            if value is not None:
                _check_run_name(name, value)
        given = sampling.pop("params", None)
        # A request that sets no max_tokens is stopped if it starts cycling (repetition_guard.py).
        guard_cycles = given is None and sampling.get("max_tokens") is None
        params = given or SamplingParams.from_kwargs(
            **apply_model_defaults(sampling, self.model_info.sampling_defaults)
        )
        if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools)):
            raise InvalidRequestError("tools must be a list of OpenAI tool dicts", param="tools")
        check_text(params.stop, "stop")
        check_text(response_format, "response_format")
        check_text(tools, "tools")
        check_text(tool_choice, "tool_choice")
        grammar = compile_constraint(
            self.tokenizer, self.model_info.vocab_size, response_format=response_format,
            tools=list(tools) if tools else None, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
        ) if (response_format is not None or tools) else None
        self._check_speculative(params)
        lora_adapter = self._resolve_adapter(adapter, params)
        ids = self._prompt_ids(prompt)
        ctx = self.context_window
        if len(ids) >= ctx:
            raise ContextLengthExceededError(
                f"prompt has {len(ids)} tokens; the model's context window is {ctx} "
                "(at least one token must be left to generate)",
                param="prompt",
            )
        room = ctx - len(ids)
        if params.max_tokens is None or params.max_tokens > room:
            # Never more than the context leaves (a copy: a caller's ``params`` may serve other prompts).
            params = dataclasses.replace(params, max_tokens=room)
        self.core.take_queue_slot()
        req = Request(ids, params, Channel(loop), grammar=grammar, request_id=request_id,
                      tools=list(tools) if tools else None, priority=priority, group=group)
        req.adapter = lora_adapter
        req.session = session
        req.program = program if program is not None else session
        req.cycle_guard = guard_cycles
        req.span = request_span(req, self.model_name)  # None unless OpenTelemetry tracing is on (tracing.py)
        if isinstance(prompt, VisionPrompt):
            req.vision = prompt
            if submit_after_encoding(self, req):  # a new image: encoded off the engine thread first
                return RequestHandle(self, req)
        self.core.enqueue_add(req)
        return RequestHandle(self, req)

    def run_on_engine_thread(self, fn, timeout: float | None = None):
        """Run ``fn()`` between steps on the engine thread (for tests and maintenance)."""
        return self.core.call(fn, timeout)

    def load_adapter(self, name: str, path: str | os.PathLike) -> None:
        """Register (or re-point) the LoRA adapter ``name`` at ``path`` and load it now (checked against
        the model: :class:`AdapterLoadError` if it does not fit)."""
        self.adapters.register(name, path)
        lora.attach(self.model, self.adapters.max_loaded)

    def _resolve_adapter(self, adapter, params: SamplingParams):
        if adapter is None:
            return None
        if self.dist is not None:
            raise InvalidRequestError("LoRA adapters are not supported by the distributed mode", param="adapter")
        spec = params.speculative
        if spec is not None and spec.enabled and spec.method == "draft":
            raise InvalidRequestError("a draft model drafts for the base model only: use speculative "
                                      "{'method': 'ngram'} (or none) with a LoRA adapter", param="speculative")
        resolved = self.adapters.resolve(adapter)
        lora.attach(self.model, self.adapters.max_loaded)
        return resolved

    def _check_speculative(self, params: SamplingParams) -> None:
        """A request that asks for speculation where it cannot run is refused (typed), never run wrong."""
        spec = params.speculative
        if spec is None or not spec.enabled:
            return
        if self.dist is not None:
            raise InvalidRequestError("speculative decoding is not supported by the distributed mode",
                                      param="speculative")
        if self._scheduler.speculator is None:
            raise InvalidRequestError(self._scheduler.no_speculation, param="speculative")
        if params.needs_penalties:
            raise InvalidRequestError("speculative decoding is not supported together with repetition / "
                                      "presence / frequency penalties", param="speculative")
        self._check_draft(spec)

    def _check_draft(self, spec) -> None:
        """The draft-model method: its model is loaded (once per process) and checked against this
        engine's model here, on the caller's thread, so the engine thread finds it ready."""
        if spec is not None and spec.enabled and spec.method == "draft":
            from parallm_engine.spec.draft_model import resolve_draft

            resolve_draft(spec, self.model, self.tokenizer, self.model_info, kernels=self.config.cpu_kernels)

    def abort(self, request: str | Request) -> None:
        """Abort a request (its id, or the ``Request``; ``RequestHandle.abort`` passes the latter). The
        engine frees its memory between steps; given the ``Request``, its queue slot is free at once."""
        req = request if isinstance(request, Request) else None
        request_id = request.id if req is not None else request
        note_abort(self, request_id)  # still at the vision encoder: cancelled once it reaches the scheduler
        self.core.enqueue_abort(request_id, req)

    # -- observability --------------------------------------------------------------------------
    def stats(self) -> dict:
        """Engine-wide counters and gauges. Safe from any thread while the engine runs: the queue lengths
        and the prefix-cache figures are the snapshot the engine thread published after its last step (or
        command), never read from the live structures it mutates."""
        snap = self._stats.snapshot()
        snap.update(self._stats.published)
        snap["waiting"] = snap.get("waiting", 0) + self.core.pending
        snap["model"] = self.model_name
        snap["weight_bytes"] = self.weight_bytes
        vision = getattr(self.model, "vision", None)
        if vision is not None:
            snap["vision"] = vision.stats()
        snap["adapters"] = {**self.adapters.stats(), **snap.pop("lora", {})}
        if self.dist is not None:
            snap["distributed"] = self.dist.describe()
            stage = getattr(self.model, "stage_outputs", None)
            if stage is not None:  # a pipeline: its micro-batches (lanes), and the most that ran in one step
                snap["distributed"]["micro_batches"] = {"lanes": self.config.decode_lanes,
                                                        "most_in_one_step": stage.most}
        return snap

    def timeline(self, since: float = 0.0) -> dict:
        """What the engine did (JSON-able, any thread): each recent request's lifecycle (arrival, admission,
        first token, finish and its reason, tokens, preemptions) and each recent step (times, prefill tokens,
        decode rows), those active at or after ``since``; times in ``time.monotonic()`` seconds, plus
        ``wall_offset`` to convert to Unix time (``timeline.py``)."""
        return self._stats.timeline.snapshot(since)

    def trace(self, path: str | os.PathLike):
        """Record a Chrome / Perfetto trace of the engine's steps and requests from now into ``path``
        (``trace_file.py``): ``with engine.trace("run.json"): ...``, or keep the recording and ``stop()`` it."""
        from parallm_engine.core.trace_file import TraceRecording

        return TraceRecording(self._stats.timeline, path)

    def reset_peaks(self) -> None:
        self._stats.reset_peaks()

    def clear_prefix_cache(self) -> int:
        """Drop every prefix the radix tree holds that no running request uses; returns bytes freed. The
        lanes' page pools then shrink to the pages still in use (an idle engine keeps no KV arrays), so the
        memory goes back at once, not at the next step."""
        cache = self._scheduler.prefix_cache
        if cache is None:
            return 0

        return self.core.call(self._clear_prefix_cache_now, mirror=("clear_prefix_cache", ()))

    def _clear_prefix_cache_now(self) -> int:
        """Engine thread: :meth:`clear_prefix_cache`'s work."""
        cache = self._scheduler.prefix_cache
        self._scheduler.kv.release_session(None)  # what sessions kept goes too
        freed = cache.clear_unpinned()
        self._scheduler.kv.trim()
        return freed

    def run_mirrored_here(self, name: str, *args):
        """A distributed engine's follower repeats rank 0's maintenance call ``name`` (``MIRRORED_CALLS``)."""
        if name == "clear_prefix_cache":
            return self._clear_prefix_cache_now() if self._scheduler.prefix_cache is not None else 0
        if name == "release_session":
            return self._scheduler.kv.release_session(*args)
        raise ValueError(f"not a mirrored call: {name!r}")

    def release_session(self, session: str | None = None) -> int:
        """``session`` (None: every session) lets go of the context it kept pinned; returns how many did.
        What it let go stays cached as any prefix does, evicted least recently used."""
        return self.core.call(lambda: self._scheduler.kv.release_session(session),
                              mirror=("release_session", (session,)))

    def close_session(self, session: str) -> dict:
        """The agent run named ``session`` (a session or a program) is over: its pinned context is let go now
        (it stays cached as any prefix does) and its program's figures leave ``stats()["programs"]``. Returns
        what was closed: ``{"released": pins let go, "program": whether figures were dropped}``."""
        _check_run_name("session", session)

        def close():
            return {"released": self._scheduler.kv.release_session(session),
                    "program": self._stats.forget_program(session)}
        return self.core.call(close, mirror=("release_session", (session,)))

    def shutdown(self, timeout: float = 10.0) -> None:
        self.core.shutdown(timeout)
        if getattr(self.model, "vision", None) is not None:
            self.model.vision.close()


def _check_run_name(param: str, value) -> None:
    """A session or program name: a non-empty string of at most 256 characters."""
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        raise InvalidRequestError(f"{param} must be a non-empty string of at most 256 characters", param=param)


def _bf16_dot_kernel() -> bool:
    """Whether the native kernels run bfloat16 matmuls with AVX512_BF16 here (``weights_dtype``)."""
    from parallm_engine.runner.weights_dtype import bf16_dot_kernel

    return bf16_dot_kernel() is not None


def _batch_invariance_line(done, device: str) -> str:
    """What ``Backend.batch_invariance`` says: whether a row's bits are independent of its batch here."""
    if device != "cpu":
        return "not managed on the GPU (its matmul kernels choose by shape)"
    return done.describe() if done is not None else "off (batch_invariant=False / PARALLM_BATCH_INVARIANT=0)"

