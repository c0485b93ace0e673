"""The continuous-batching scheduler. Runs only on the engine thread.

One ``step()``: admit waiting sequences under the batch and KV budgets; prefill new ones in chunks
(prompt prefixes come from the radix cache; sequences are prefilled one after another, so requests
that arrive together with the same uncached prefix compute it once: the first inserts it, the next
ones hit it); move prefilled sequences into the decode batch (rows continuing one cached prefix hold
it once: ``prefix_sharing``); run one decode step for every running sequence; sample, detokenise,
check stops, deliver deltas; retire finished sequences, keeping their KV in the radix tree for the
next turn.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .chat_format import parse_tool_calls
from .constrained import apply_constraints
from .detokenizer import IncrementalDetokenizer
from .errors import RequestCancelledError
from . import cpu_kernels
from .decode_batch import DecodeBatch
from .kv_cache import PrefillBatchKV, SequenceKV, prefill_layout
from .prefix_sharing import shared_prefix_flags
from .radix_cache import PrefixMatch, RadixCache
from .request import Choice, GenerationResult, Request, StreamDelta, TokenLogprob, _Done
from .sampling import SeqSampler, sample_batch, top_logprobs_for
from .stats import EngineStats

logger = logging.getLogger("parallm_engine")


@dataclass
class SchedulerConfig:
    max_batch_size: int = 64  # sequences decoding at once
    prefill_chunk: int = 512  # tokens per prefill forward
    prefill_budget: int = 2048  # prefill tokens per step, so decoding keeps moving
    kv_budget_bytes: int = 4 << 30  # running-batch KV (admission control)
    radix_budget_bytes: int = 1 << 30  # prefix tree
    enable_prefix_cache: bool = True
    pipeline: bool = True  # overlap host work with the next decode step (see Scheduler._decode)
    decode_lanes: int = 1  # parallel decode lanes (CPU cores; see decode_batch)
    cpu_kernels: bool = False  # faster attention/SwiGLU on MLX's CPU backend (see cpu_kernels)


class Sequence:
    """One generated choice of a request."""

    def __init__(self, request: Request, index: int, tokenizer, eos_ids: set[int]):
        p = request.params
        self.request = request
        self.index = index
        self.prompt_ids = request.prompt_ids
        self.sampler = SeqSampler(p, request.prompt_ids, seed_offset=index)
        self.detok = IncrementalDetokenizer(tokenizer, p.stop, p.include_stop_str_in_output)
        self.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if p.logprobs else None
        self.max_new = p.max_tokens
        self.cache: list[SequenceKV] | None = None  # during prefill
        self.pos = 0  # prompt tokens prefilled so far
        self.match: PrefixMatch | None = None  # pinned radix match during prefill
        self.cached_tokens = 0
        self.tree_tokens = 0  # leading prompt tokens whose KV is bitwise the radix tree's copy
        self.started = False  # looked up in the radix tree (and pinned) yet?
        self.prefix_kv = None  # the matched prefix's KV until the prefill uses it
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.constraint = request.grammar() if request.grammar is not None else None

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class Scheduler:
    def __init__(self, model, tokenizer, model_info, config: SchedulerConfig, stats: EngineStats):
        self.model = model
        self.tokenizer = tokenizer
        self.info = model_info
        self.config = config
        self.stats = stats
        self.n_layers = len(model.layers)
        self.batch = DecodeBatch(self.n_layers, config.decode_lanes)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.radix = RadixCache(config.radix_budget_bytes) if config.enable_prefix_cache else None
        self.eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        itemsize = np.dtype(str(model_info.dtype).replace("bfloat16", "float16")).itemsize
        self.kv_bytes_per_token = model_info.kv_bytes_per_token(itemsize)
        self.requests: dict[str, Request] = {}
        self._choices: dict[str, list[Choice | None]] = {}
        self._lm_head = _lm_head(model)
        self._cpu_kernels = config.cpu_kernels and cpu_kernels.install(model, model_info.context_window)
        # Build/load the native kernels now, not in the middle of the first decode step.
        self.native_kernels = bool(self._cpu_kernels and cpu_kernels.native_available())
        # Decode rows continuing one cached prefix hold it once (cascade attention): needs the radix
        # tree (where the prefix's one copy comes from), the engine's attention hook, and full
        # attention in every layer (a sliding window would have to cut into the shared prefix).
        self._share_prefix = bool(self._cpu_kernels and self.radix is not None
                                  and cpu_kernels.handles_shared_prefix(model)
                                  and not _sliding_window(getattr(model_info, "config", None) or {}))
        # A pipelined decode step in flight: (sequences, tokens, logprob rows, chosen logprobs).
        self._pending: tuple | None = None

    @property
    def running(self) -> list[Sequence]:
        """The decoding sequences; row i of the batch's logits is ``running[i]``."""
        return self.batch.running

    # -- bookkeeping ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self._pending is not None)

    def add(self, request: Request) -> None:
        # Build every sequence first: if one fails (a grammar, a sampler), nothing is registered.
        seqs = [Sequence(request, i, self.tokenizer, self.eos_ids) for i in range(request.params.n)]
        self.requests[request.id] = request
        self._choices[request.id] = [None] * request.params.n
        self.waiting.extend(seqs)
        self.stats.on_submit(request)

    def reject(self, request: Request, error: BaseException) -> None:
        """A request whose sequences could not be built: fail it alone (nothing of it is queued)."""
        self._end_request(request, error)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        for s in [s for s in self.waiting if s.request is req]:
            self.waiting.remove(s)
        for s in [s for s in self.prefilling if s.request is req]:
            self.prefilling.remove(s)
            self._release_prefill(s)
        rows = {id(s) for s in self.running if s.request is req}
        if rows:
            self._drop_rows(rows)
        self.stats.on_abort(req)
        self.stats.running = len(self.running)
        self.stats.kv_bytes = self.batch_kv_bytes()  # an idle engine runs no step to update it
        self._end_request(req, RequestCancelledError(f"request {req.id} was cancelled"))

    def fail_all(self, error: BaseException) -> None:
        for req in list(self.requests.values()):
            self._end_request(req, error)
        self.waiting.clear()
        self.prefilling.clear()
        self._pending = None
        self.batch.clear()

    def batch_kv_bytes(self) -> int:
        return self.batch.nbytes()

    def _projected_bytes(self, seq: Sequence) -> int:
        return (len(seq.prompt_ids) + (seq.max_new or 0)) * self.kv_bytes_per_token

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> None:
        self._admit()
        with cpu_kernels.enabled(self._cpu_kernels):
            joined = self._prefill()
            if joined:
                self._join(joined)
            if self.running:
                self._decode()
            elif self._pending is not None:
                self._flush_pending()
        self.stats.on_step(len(self.running), self.batch_kv_bytes())

    def _admit(self) -> None:
        active = len(self.running) + len(self.prefilling)
        projected = sum(self._projected_bytes(s) for s in self.running) + sum(
            self._projected_bytes(s) for s in self.prefilling
        )
        while self.waiting and active < self.config.max_batch_size:
            seq = self.waiting[0]
            need = self._projected_bytes(seq)
            # Always admit when idle, so one oversized request still runs rather than waiting forever.
            if active and projected + need > self.config.kv_budget_bytes:
                break
            self.waiting.popleft()
            self.prefilling.append(seq)
            active += 1
            projected += need

    def _start_prefill(self, seq: Sequence) -> None:
        """Look the prompt up in the radix tree and pin what matched until the prefill is done."""
        prompt = seq.prompt_ids
        seq.prefix_kv = None
        if self.radix is not None:
            # Match at most len-1 tokens: the last prompt token must run to give the first logits.
            seq.match = self.radix.match(prompt[:-1])
            self.radix.pin(seq.match.node)
            seq.cached_tokens = seq.match.length
            seq.prefix_kv = self.radix.gather(seq.match) if seq.match.length else None
        seq.pos = seq.cached_tokens
        seq.started = True

    def _cached_len(self, seq: Sequence) -> int:
        """Prompt tokens the radix tree holds for ``seq`` now (a peek: nothing is pinned or counted)."""
        if self.radix is None:
            return 0
        return self.radix.match(seq.prompt_ids[:-1], record=False).length

    def _uncached_overlap(self, seq: Sequence, group: list[Sequence], cached: int) -> bool:
        """Would ``seq`` recompute new tokens another group member is about to compute? Then it waits
        one step and finds them in the radix tree (in-flight dedup of a shared uncached prefix)."""
        if self.radix is None:
            return False
        for g in group:
            common = 0
            for a, b in zip(seq.prompt_ids, g.prompt_ids):
                if a != b:
                    break
                common += 1
            if common > cached + 8:
                return True
        return False

    def _release_prefill(self, seq: Sequence) -> None:
        if seq.match is not None and self.radix is not None:
            self.radix.unpin(seq.match.node)
        seq.match = None
        seq.cache = None
        seq.prefix_kv = None

    def _prefill(self) -> list[Sequence]:
        """Spend up to ``prefill_budget`` prompt tokens this step. A prompt longer than one chunk is
        prefilled alone, chunk by chunk, across steps; shorter ones are prefilled together in forward
        passes (groups) of at most one chunk of tokens, except those whose uncached prefix a group
        member is computing. Each group's first tokens are delivered before the next group runs: a
        burst of requests (the agent fan-out) gets its first tokens group by group instead of all at
        the end, at the same cost (a chunk already fills the GEMMs)."""
        budget = self.config.prefill_budget
        chunk = self.config.prefill_chunk
        done: list[Sequence] = []
        while self.prefilling and budget > 0:
            head = self.prefilling[0]
            if not head.started:
                self._start_prefill(head)
            if head.cache is not None or len(head.prompt_ids) - head.pos > chunk:
                budget -= self._prefill_chunk(head, min(chunk, budget), done)
                continue
            group, used = [head], len(head.prompt_ids) - head.pos
            for seq in list(self.prefilling)[1:]:
                if len(group) >= self.config.max_batch_size:
                    break
                if seq.cache is not None:
                    continue
                cached = seq.pos if seq.started else self._cached_len(seq)
                remaining = len(seq.prompt_ids) - cached
                if used + remaining > min(chunk, budget):
                    continue
                if not seq.started and self._uncached_overlap(seq, group, cached):
                    continue
                if not seq.started:
                    self._start_prefill(seq)
                group.append(seq)
                used += len(seq.prompt_ids) - seq.pos
            for seq in group:
                self.prefilling.remove(seq)
            self._prefill_group(group, done)
            budget -= used
        return done

    def _prefill_chunk(self, seq: Sequence, n_max: int, done: list[Sequence]) -> int:
        """One chunk of a long prompt through a single-sequence cache."""
        if seq.cache is None:
            if seq.prefix_kv is not None:
                seq.cache = [SequenceKV(k, v) for k, v in seq.prefix_kv]
            else:
                seq.cache = [SequenceKV() for _ in range(self.n_layers)]
            seq.prefix_kv = None
        prompt = seq.prompt_ids
        n = min(n_max, len(prompt) - seq.pos)
        h = self.model.model(mx.array(prompt[seq.pos : seq.pos + n])[None], cache=seq.cache)
        seq.pos += n
        self.stats.prefill_tokens += n
        self.stats.prefill_forwards += 1
        if seq.pos < len(prompt):
            mx.eval([c.keys for c in seq.cache])
            return n
        self.prefilling.popleft()
        logits = self._lm_head(h[:, -1, :]).astype(mx.float32)
        self._sample_and_emit([seq], logits)
        self._prompt_done(seq, done)
        return n

    def _prefill_group(self, group: list[Sequence], done: list[Sequence]) -> None:
        """Prefill several short prompts (each with its own cached prefix) in one forward pass per
        decode lane: the group is split into token-balanced shares that run at the same time on the
        lanes' streams (one share on Metal/CUDA), then sampled together."""
        shares = _split_balanced(group, [len(s.prompt_ids) - s.pos for s in group], len(self.batch.lanes))
        contexts = self.batch.lane_contexts()
        logits, finish = [], []
        for share, ctx in zip(shares, contexts):
            with ctx:
                lg, fin = self._prefill_forward(share)
            logits.append(lg)
            finish.append(fin)
        ordered = [s for share in shares for s in share]
        self._sample_and_emit(ordered, logits[0] if len(logits) == 1 else mx.concatenate(logits))
        for fin in finish:
            fin(done)

    def _prefill_forward(self, group: list[Sequence]):
        """Lazy: the group's last-position logits, and a function that hands each sequence its KV."""
        prefix_lens = [s.cached_tokens for s in group]
        new_lens = [len(s.prompt_ids) - s.pos for s in group]
        offset, mask, P, L = prefill_layout(prefix_lens, new_lens)
        tokens = mx.array([[0] * (L - n) + s.prompt_ids[s.pos :] for s, n in zip(group, new_lens)])
        caches = []
        dtype = next((s.prefix_kv[0][0].dtype for s in group if s.prefix_kv), None)
        shared = P and all(p == P for p in prefix_lens) and all(s.prefix_kv is not None for s in group)
        for layer in range(self.n_layers):
            if shared and all(s.prefix_kv[layer][0] is group[0].prefix_kv[layer][0] for s in group[1:]):
                # Every row continues the same cached prefix (the agent fan-out). With the engine's
                # attention hook it is read once for all rows (cascade attention); otherwise it is
                # broadcast, and the attention's concatenation makes the only copy.
                k, v = group[0].prefix_kv[layer]
                if self._share_prefix:
                    caches.append(PrefillBatchKV(k, v, offset, mask, shared=True))
                else:
                    caches.append(PrefillBatchKV(mx.broadcast_to(k, (len(group), *k.shape[1:])),
                                                 mx.broadcast_to(v, (len(group), *v.shape[1:])), offset, mask))
            elif P:
                pk, pv = [], []
                for s, p in zip(group, prefix_lens):
                    if p:
                        k, v = s.prefix_kv[layer]
                        pad = [(0, 0), (0, 0), (P - p, 0), (0, 0)]
                        pk.append(mx.pad(k, pad))
                        pv.append(mx.pad(v, pad))
                    else:
                        H, D = self.info.num_kv_heads, self.info.head_dim
                        zeros = mx.zeros((1, H, P, D), dtype=dtype)
                        pk.append(zeros)
                        pv.append(zeros)
                caches.append(PrefillBatchKV(mx.concatenate(pk), mx.concatenate(pv), offset, mask))
            else:
                caches.append(PrefillBatchKV(None, None, offset, mask))
        h = self.model.model(tokens, cache=caches)
        self.stats.prefill_tokens += sum(new_lens)
        self.stats.prefill_forwards += 1
        logits = self._lm_head(h[:, -1, :]).astype(mx.float32)

        def finish(done: list[Sequence]) -> None:
            for i, (s, p, n) in enumerate(zip(group, prefix_lens, new_lens)):
                s.cache = [c.row(i, p, n, P, L) for c in caches]
                s.prefix_kv = None
                self._prompt_done(s, done)

        return logits, finish

    def _prompt_done(self, seq: Sequence, done: list[Sequence]) -> None:
        """Prompt fully prefilled: store it in the tree, hand the sequence to the decode batch."""
        if self.radix is not None:
            cache = seq.cache
            # The tree keeps the copy that got there first: the sequence's KV is bitwise the tree's for
            # what it read from the tree and what it inserts now, unless someone else inserted tokens
            # it also computed (then only the part it read).
            held = self.radix.insert(seq.prompt_ids, lambda a, b: [c.segment(a, b) for c in cache]).held
            seq.tree_tokens = len(seq.prompt_ids) if held <= seq.cached_tokens else seq.cached_tokens
        self.stats.on_prompt_done(seq.request, seq.cached_tokens if seq.index == 0 else None)
        if seq.finish_reason is None:
            done.append(seq)
            self._release_prefill_keep_cache(seq)
        else:  # finished on its first token: never joins the batch
            self._release_prefill(seq)

    def _release_prefill_keep_cache(self, seq: Sequence) -> None:
        if seq.match is not None and self.radix is not None:
            self.radix.unpin(seq.match.node)
        seq.match = None
        seq.prefix_kv = None

    def _join(self, seqs: list[Sequence]) -> None:
        flags = shared_prefix_flags(self.batch, self.radix, seqs) if self._share_prefix else None
        self.batch.join(seqs, flags)

    def _decode(self) -> None:
        """One decode step for every running sequence.

        Pipelined when no running sequence needs host state that depends on the previous token
        (penalties): the step's graph is built on the previous step's tokens while they are still
        being computed, ``async_eval`` starts it, and the host then detokenises, checks stops and
        delivers the previous step's tokens while this one runs (as mlx-lm's generate loop does).
        A sequence that stopped has computed one wasted step; its row is dropped. With grammar
        constraints in the batch, the forward is started first, the previous step is delivered
        (advancing the matchers) and the masks are computed while it runs; only the sampling waits.
        """
        pipelined = self.config.pipeline and not any(s.sampler.params.needs_penalties for s in self.running)
        constrained = pipelined and any(s.constraint is not None for s in self.running)
        if self._pending is not None and not pipelined:
            self._flush_pending()
            if not self.running:
                return
        running = self.running
        if self._pending is not None:
            inputs = _next_inputs(running, self._pending[0], self._pending[1])
        else:
            inputs = mx.array([s.output_ids[-1] for s in running])
        logits = self.batch.forward(self.model.model, self._lm_head, inputs)
        self.stats.decode_steps += 1
        if constrained:  # masks need the previous tokens: deliver them while the forward runs
            mx.async_eval(logits)
            previous, self._pending = self._pending, None
            if previous is not None:
                self._deliver(*previous)
            sampled = self._sample(self.running, logits)
            mx.async_eval([x for x in sampled if x is not None])
            self._pending = (list(self.running), *sampled)
        elif pipelined:
            sampled = self._sample(self.running, logits)
            mx.async_eval([x for x in sampled if x is not None])
            previous, self._pending = self._pending, (list(self.running), *sampled)
            if previous is not None:
                self._deliver(*previous)
        else:
            self._deliver(self.running, *self._sample(self.running, logits))
        finished = {id(s) for s in self.running if s.finish_reason is not None}
        if finished:
            self._retire_rows(finished)

    def _flush_pending(self) -> None:
        """Deliver the last pipelined step's tokens now (the batch is about to change mode or idle)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self._deliver(*pending)
        finished = {id(s) for s in self.running if s.finish_reason is not None}
        if finished:
            self._retire_rows(finished)

    # -- sampling and delivery ------------------------------------------------------------------
    def _sample_and_emit(self, seqs: list[Sequence], logits: mx.array) -> None:
        self._deliver(seqs, *self._sample(seqs, logits))

    def _sample(self, seqs: list[Sequence], logits: mx.array):
        """Lazy: (tokens, logprobs rows for sequences that asked, chosen-token logprobs)."""
        samplers = [s.sampler for s in seqs]
        if any(s.constraint is not None for s in seqs):
            # Rows already finished (still in a pipelined step) are left unmasked; their tokens are dropped.
            logits = apply_constraints(logits, [s.constraint if s.finish_reason is None else None for s in seqs])
        toks, logprobs = sample_batch(logits, samplers)
        if logprobs is None:
            return toks, None, None
        rows = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        chosen = logprobs[mx.arange(len(seqs)), toks]
        return toks, logprobs[mx.array(rows)] if rows else None, chosen

    def _deliver(self, seqs: list[Sequence], toks: mx.array, lp_rows, chosen) -> None:
        """Host side of a step: accept each sequence's token (stops, detokenising, delivery)."""
        tok_list = toks.tolist()
        chosen_list = chosen.tolist() if chosen is not None else None
        lp_np = np.array(lp_rows) if lp_rows is not None else None
        now = time.monotonic()
        j = 0
        for i, (s, t) in enumerate(zip(seqs, tok_list)):
            lp = None
            if s.logprobs is not None:
                k = s.request.params.top_logprobs
                tops = top_logprobs_for(lp_np[j], k) if k else []
                j += 1
                lp = TokenLogprob(
                    t, self._tok_str(t), float(chosen_list[i]), [(tid, self._tok_str(tid), v) for tid, v in tops]
                )
            if s.finish_reason is None:  # aborted/finished rows may still sit in a pipelined step
                self._accept(s, t, lp, now)

    def _tok_str(self, t: int) -> str:
        return self.tokenizer.decode([t])

    def _accept(self, s: Sequence, t: int, lp: TokenLogprob | None, now: float) -> None:
        req = s.request
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats.on_first_token(req)
        s.sampler.observe(t)
        if s.constraint is not None:
            s.constraint.advance(t)
        self.stats.generated_tokens += 1
        self.stats.on_token(req, now)
        if t in s.stop_ids:
            s.output_ids.append(t)  # kept for KV bookkeeping; not part of the text
            s.finish_reason, s.stop_reason = "stop", t
            self._emit(s, s.detok.finish(), [], None)
            return
        s.output_ids.append(t)
        if s.logprobs is not None and lp is not None:
            s.logprobs.append(lp)
        text = s.detok.add(t)
        if s.detok.stopped:
            s.finish_reason = "stop"
            s.stop_reason = s.detok.matched_stop
        elif s.max_new is not None and len(s.output_ids) >= s.max_new:
            s.finish_reason = "length"
        elif s.total_len >= self.info.context_window:
            s.finish_reason = "length"
        elif s.constraint is not None and s.constraint.is_done():
            s.finish_reason = "stop"
        if s.finish_reason is not None and not s.detok.stopped:
            text += s.detok.finish()
        self._emit(s, text, [t], lp)

    def _emit(self, s: Sequence, text: str, ids: list[int], lp: TokenLogprob | None) -> None:
        req = s.request
        delta = StreamDelta(
            request_id=req.id,
            index=s.index,
            text=text,
            token_ids=ids,
            logprobs=[lp] if lp is not None else None,
        )
        if s.finish_reason is not None:
            delta.finish_reason = s.finish_reason
            delta.stop_reason = s.stop_reason
            # The stop token is counted as generated (it was computed) but is not part of the output.
            stopped_on_token = s.finish_reason == "stop" and isinstance(s.stop_reason, int)
            out_ids = s.output_ids[:-1] if stopped_on_token else s.output_ids
            req.usage.completion_tokens += len(s.output_ids)
            choice = Choice(s.index, s.detok.text, list(out_ids), s.finish_reason, s.logprobs, s.stop_reason)
            # A grammar-constrained output cut by max_tokens does not match its grammar.
            choice.incomplete = s.constraint is not None and s.finish_reason == "length"
            if req.tools:
                choice.content, choice.tool_calls = parse_tool_calls(choice.text, req.tools)
            else:
                choice.content = choice.text
            self._choices[req.id][s.index] = choice
            req.remaining_choices -= 1
            if req.remaining_choices == 0:
                delta.usage = req.usage
                req.channel.put(delta)
                self._complete_request(req)
                return
        req.channel.put(delta)

    def _complete_request(self, req: Request) -> None:
        req.finished = True
        req.finish_time = time.monotonic()
        self.stats.on_finish(req)
        result = GenerationResult(
            request_id=req.id,
            choices=self._choices.pop(req.id),
            usage=req.usage,
            prompt_token_ids=req.prompt_ids,
            metrics={"ttft": req.ttft() or 0.0, "latency": req.finish_time - req.arrival},
        )
        req.result = result
        req.channel.put(_Done())
        self.requests.pop(req.id, None)

    def _end_request(self, req: Request, error: BaseException) -> None:
        if req.finished:
            return
        req.finished = True
        self.requests.pop(req.id, None)
        self._choices.pop(req.id, None)
        req.channel.put(_Done(error))

    # -- retiring -------------------------------------------------------------------------------
    def _retire_rows(self, rows: set[int]) -> None:
        """Drop the sequences whose ``id()`` is in ``rows``, caching their KV in the radix tree."""
        if self.radix is not None:
            for s in self.running:
                if id(s) in rows:
                    # Cache prompt + output (minus the last token, which never ran) for the next turn.
                    self.radix.insert(s.prompt_ids + s.output_ids[:-1], self.batch.row_segments(s))
        self._drop_rows(rows)

    def _drop_rows(self, rows: set[int]) -> None:
        """Remove the sequences whose ``id()`` is in ``rows`` from the batch and the step in flight."""
        self.batch.drop(rows)
        if self._pending is not None:
            seqs, toks, lp_rows, chosen = self._pending
            kept = [i for i, s in enumerate(seqs) if id(s) not in rows]
            if not kept:
                self._pending = None
            elif len(kept) < len(seqs):
                sel = mx.array(kept)
                kept_set = set(kept)
                lp_keep = [r for r, i in enumerate([i for i, s in enumerate(seqs) if s.logprobs is not None])
                           if i in kept_set]
                self._pending = (
                    [seqs[i] for i in kept],
                    toks[sel],
                    lp_rows[mx.array(lp_keep)] if lp_rows is not None and lp_keep else None,
                    chosen[sel] if chosen is not None else None,
                )


def _split_balanced(items: list, weights: list[int], n: int) -> list[list]:
    """At most ``n`` non-empty shares of ``items`` with near-equal total weight (largest first into
    the lightest share), each keeping the items' original order."""
    if n <= 1 or len(items) <= 1:
        return [list(items)]
    loads = [0] * n
    owner = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: -weights[i]):
        g = loads.index(min(loads))
        loads[g] += weights[i]
        owner[i] = g
    shares = [[x for x, o in zip(items, owner) if o == g] for g in range(n)]
    return [share for share in shares if share]


def _sliding_window(config: dict) -> bool:
    """Whether a model config asks for sliding-window attention in any layer."""
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        return True
    return any("sliding" in str(t) for t in config.get("layer_types") or [])


def _next_inputs(running: list[Sequence], prev_seqs: list[Sequence], prev_toks: mx.array) -> mx.array:
    """The next decode step's input tokens in ``running``'s row order: the pipelined step's tokens
    (still being computed) for the sequences it covered, the last sampled token for those that
    joined since."""
    pos = {id(s): i for i, s in enumerate(prev_seqs)}
    joined = [s for s in running if id(s) not in pos]
    if not joined and len(prev_seqs) == len(running) and all(a is b for a, b in zip(prev_seqs, running)):
        return prev_toks
    n = len(prev_seqs)
    extra = {id(s): n + j for j, s in enumerate(joined)}
    order = mx.array([pos[id(s)] if id(s) in pos else extra[id(s)] for s in running])
    pool = mx.concatenate([prev_toks, mx.array([s.output_ids[-1] for s in joined], dtype=prev_toks.dtype)]) \
        if joined else prev_toks
    return pool[order]


def _lm_head(model):
    """The output projection of an mlx-lm model: its own lm_head, or the tied embedding.

    The scheduler runs ``model.model`` (the trunk) and projects only the rows it samples from, so a
    512-token prefill chunk does not pay for 512 vocabulary-sized logit rows.
    """
    head = getattr(model, "lm_head", None)
    if head is not None:
        return head  # an nn.Linear: cpu_kernels.install switches it like the trunk's
    embed = model.model.embed_tokens

    def tied(h: mx.array) -> mx.array:
        y = cpu_kernels.linear_native(h, embed.weight)  # None for a quantized embedding, a prefill chunk...
        return embed.as_linear(h) if y is None else y

    return tied
