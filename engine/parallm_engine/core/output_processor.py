"""The host side of a step: sampled tokens -> stop checks, incremental text, deltas, finished results.

Runs on the engine thread after each forward. For each sequence's new token it advances the sampler's
penalty counts and the grammar, detokenises incrementally, checks stop tokens / strings / max_tokens /
the context window, sends a :class:`~parallm_engine.core.request.StreamDelta` to the caller, and on the
last choice of a request assembles the :class:`~parallm_engine.core.request.GenerationResult`. Each choice's
text goes through one :class:`~parallm_engine.formats.typed_output.TypedOutput` (the model family's tool-call /
reasoning format): its typed pieces ride on the deltas (``StreamDelta.pieces``) and the finished choice's
content, reasoning and calls are what those pieces concatenate to.
"""

from __future__ import annotations

import time

import numpy as np

from parallm_engine.formats.chat_format import parser_for
from parallm_engine.core.request import Choice, GenerationResult, Request, StreamDelta, TokenLogprob, _Done
from parallm_engine.core.timeline import request_timings
from parallm_engine.sampling.sampler import top_logprobs_for
from parallm_engine.formats.typed_output import TypedOutput


class OutputProcessor:
    def __init__(self, tokenizer, stats, context_window: int):
        self.tokenizer = tokenizer
        self.stats = stats
        self.context_window = context_window
        self.output_parser = parser_for(tokenizer)  # the model family's tool-call / reasoning format
        self.requests: dict[str, Request] = {}
        self._choices: dict[str, list[Choice | None]] = {}
        self._typed: dict[str, list[TypedOutput | None]] = {}

    def register(self, request: Request) -> None:
        self.requests[request.id] = request
        self._choices[request.id] = [None] * request.params.n
        self._typed[request.id] = [None] * request.params.n

    def _typed_output(self, req: Request, index: int) -> TypedOutput:
        outs = self._typed.setdefault(req.id, [None] * req.params.n)
        out = outs[index]
        if out is None:
            out = outs[index] = TypedOutput(self.output_parser, req.tools, req.prompt_ids)
        return out

    def deliver(self, seqs: list, toks, lp_rows, chosen) -> None:
        """Accept each sequence's sampled token (``toks`` one per row of ``seqs``)."""
        t0 = time.perf_counter()
        tok_list = toks.tolist()  # blocks until the device has the tokens: the step's device wait
        self.stats.device_wait_s += time.perf_counter() - t0
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
                lp = TokenLogprob(t, self._tok_str(t), float(chosen_list[i]),
                                  [(tid, self._tok_str(tid), v) for tid, v in tops])
            if s.finish_reason is None:  # aborted/finished rows may still sit in a pipelined step
                self.accept(s, t, lp, now)

    def _tok_str(self, t: int) -> str:
        return self.tokenizer.decode([t])

    def accept(self, s, t: int, lp: TokenLogprob | None, now: float) -> None:
        req = s.request
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats.on_first_token(req)
        s.sampler.observe(t)
        # The reasoning tracker counts it (and may force the close next); a grammar is the answer's, so it
        # does not see a think span's tokens (reasoning_budget.py).
        in_span = s.reasoning is not None and t not in s.stop_ids and s.reasoning.advance(t)
        if s.constraint is not None and not in_span:
            s.constraint.advance(t)
        self.stats.generated_tokens += 1
        self.stats.on_token(req, now)
        if t in s.stop_ids:
            s.output_ids.append(t)  # kept for KV bookkeeping; not part of the text
            s.finish_reason, s.stop_reason = "stop", t
            self.emit(s, s.detok.finish(), [], None)
            return
        s.output_ids.append(t)
        if s.logprobs is not None and lp is not None:
            s.logprobs.append(lp)
        text = s.detok.add(t)
        if s.detok.stopped:
            s.finish_reason = "stop"
            s.stop_reason = s.detok.matched_stop
        elif s.constraint is not None and s.constraint.is_done():
            s.finish_reason = "stop"  # the grammar is complete: whole, even when this was the last token allowed
        elif s.max_new is not None and len(s.output_ids) >= s.max_new:
            s.finish_reason = "length"
        elif s.total_len >= self.context_window:
            s.finish_reason = "length"
        elif s.cycle_guard is not None and s.cycle_guard.cycling(s.output_ids):
            s.finish_reason = "length"  # cut short: one block repeated (a request that set no max_tokens)
        if s.finish_reason is not None and not s.detok.stopped:
            text += s.detok.finish()
        self.emit(s, text, [t], lp)

    def emit(self, s, text: str, ids: list[int], lp: TokenLogprob | None) -> None:
        req = s.request
        out = self._typed_output(req, s.index)
        pieces = out.feed(text)
        if s.finish_reason is not None:
            pieces += out.finish(s.finish_reason)
        delta = StreamDelta(request_id=req.id, index=s.index, text=text, token_ids=ids,
                            logprobs=[lp] if lp is not None else None, pieces=pieces)
        if s.finish_reason is not None:
            delta.finish_reason = s.finish_reason
            delta.stop_reason = s.stop_reason
            # The stop token is counted as generated (it was computed) but is not part of the output.
            stopped_on_token = s.finish_reason == "stop" and isinstance(s.stop_reason, int)
            out_ids = s.output_ids[:-1] if stopped_on_token else s.output_ids
            req.usage.completion_tokens += len(s.output_ids)
            if s.reasoning is not None:
                req.usage.reasoning_tokens += s.reasoning.tokens
            choice = Choice(s.index, s.detok.text, list(out_ids), s.finish_reason, s.logprobs, s.stop_reason)
            # A grammar-constrained output cut by max_tokens does not match its grammar.
            choice.incomplete = s.constraint is not None and s.finish_reason == "length"
            choice.content, choice.reasoning, choice.tool_calls = out.content, out.reasoning or None, out.calls
            self._choices[req.id][s.index] = choice
            req.remaining_choices -= 1
            if req.remaining_choices == 0:
                _stamp_finish(req)  # its timings ride on the last delta's usage
                delta.usage = req.usage
                req.channel.put(delta)
                self.complete(req)
                return
        req.channel.put(delta)

    def complete(self, req: Request, result=None) -> None:
        """Finish ``req``: its GenerationResult from the choices, or ``result`` (an embedding's)."""
        req.finished = True
        if req.finish_time is None:
            _stamp_finish(req)
        self.stats.on_finish(req)
        choices = self._choices.pop(req.id, None)
        self._typed.pop(req.id, None)
        req.result = result or GenerationResult(
            request_id=req.id,
            choices=choices,
            usage=req.usage,
            prompt_token_ids=req.prompt_ids,
            metrics={"ttft": req.ttft() or 0.0, "latency": req.finish_time - req.arrival,
                     **req.usage.timings_dict(), "cached_tokens": req.usage.cached_tokens},
        )
        req.channel.put(_Done())
        self.requests.pop(req.id, None)

    def end(self, req: Request, error: BaseException) -> None:
        """End ``req`` with ``error`` (cancelled, rejected, or the engine failing)."""
        if req.finished:
            return
        req.finished = True
        self.requests.pop(req.id, None)
        self._choices.pop(req.id, None)
        self._typed.pop(req.id, None)
        req.channel.put(_Done(error))


def _stamp_finish(req: Request) -> None:
    """``req`` ends now: its finish time, and its seconds per phase in its usage."""
    req.finish_time = time.monotonic()
    t = request_timings(req)
    req.usage.queue_s, req.usage.prefill_s, req.usage.decode_s = t["queue_s"], t["prefill_s"], t["decode_s"]
