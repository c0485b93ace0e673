"""Speculative decoding inside the running batch: n-gram (prompt lookup) proposals, verification of
every speculating row's 1 + k positions in one forward of the target, exact acceptance, KV rollback.
Rows asking for the draft-model method get their proposals from a draft model instead (``plan`` hands
them to ``draft_model.DraftRows``: greedy drafts, so the same acceptance test is exact for them too).

A step speculates when some running row asks for it (``SamplingParams.speculative`` or the engine's
default) and, for adaptive rows (the default), when the width that the measured step costs and the
rows' acceptance rates make best promises more tokens per second than a plain step (``spec_policy``;
:meth:`Speculator.wants`). Then the scheduler's pipelined step in flight is delivered first (proposals
need the latest tokens on the host), each row proposes up to ``k`` tokens (the continuation of the
latest earlier occurrence of its context's last n-gram in its own prompt + output), and one forward
runs every row over its own 1 + k positions (a ragged step: ``BatchForward.forward_ragged``; a row
without drafts costs one position). Where the model's attention does not go through the engine's hook
the forward is a (B, 1 + max k) rectangle instead: shorter rows are padded, their extra positions
computed and dropped.

Acceptance is exact. At every verified position j of a row the target's own sampler draws a token
t_j with the same settings and, for a seeded row, the same key it would use without speculation
(the row's key chain is advanced by the tokens emitted, not by the positions verified). The draft
d_{j+1} is accepted when t_j == d_{j+1}; at the first mismatch t_j is emitted and the row stops. For
a deterministic proposal this *is* speculative rejection sampling: d is accepted with probability
p(d), and given a rejection t is distributed as p with d removed and renormalised (the residual).
Greedy rows are argmax at every position. So the output equals non-speculative decoding token for
token (greedy, and seeded sampling), and follows the target distribution otherwise.

Rollback without copying: every row emits its whole accepted run and keeps the KV of exactly those
positions (its page table just ends there: ``kv_pages.PagedLaneKV.rollback_rows``; pages left empty are
freed). So each row gains what it accepted, whatever the rows beside it accepted. The KV of rejected positions is never read
again and never reaches the radix tree (it stores only what ``consumed`` covers). A grammar-constrained
row's drafts are cut where its grammar forbids a token
(llguidance's ``validate_tokens``), and each verified position is masked with the grammar's state after
the drafts before it (the matcher is rolled back afterwards). Rows with penalties (their distribution
depends on counts the drafts would change) do not speculate (a request asking for both is refused at
submit), nor do rows whose reasoning budget may force their next token; ``model_caches``' "mixed" layout (sliding windows, recurrent state) cannot roll back and
refuses speculation at submit.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from parallm_engine.sampling.constrained import apply_constraints
from parallm_engine.sampling.reasoning_budget import allow_tokens, force_tokens, forced_rows, row_grammars, row_openers
from parallm_engine.spec.draft_model import DraftRows, loaded_draft
from parallm_engine.sampling.sampler import sample_batch
from parallm_engine.sampling.spec_config import SpeculativeConfig
from parallm_engine.spec.spec_policy import RealizedGain, StepCost, choose_width

#: Positions (rows x width) one speculative forward may hold, at most. Within it the width is chosen by
#: what steps are measured to cost on this machine (``spec_policy``): a forward's cost grows with its
#: positions where the step is compute-bound (a CPU's large batch) and hardly at all where it is bound by
#: reading the weights.
TOKEN_BUDGET = 256
#: Above this many running rows a step does not speculate.
MAX_SPEC_BATCH = 64
#: Positions per row in one forward, at most: the scheduler's watermark (every running row has room for
#: 16 more tokens of KV before a step starts).
MAX_WIDTH = 16
#: A row whose acceptance rate falls below this rests for ``_REST`` steps, then tries again.
_MIN_RATE = 0.15
_REST = 8
_MAX_DRAFT_REST = 64
#: Without speculating, a row's estimated acceptance rate recovers towards this by this fraction per step.
_RETRY_RATE = 0.6
_RATE_RECOVERY = 0.1
#: Steps without looking for drafts after a step found none in any row.
_COOLDOWN = 2


class NgramIndex:
    """Prompt lookup over one sequence's context: for each n in [min_match, max_match], the latest
    position that followed each n-gram. Extended incrementally as the context grows."""

    def __init__(self, min_match: int, max_match: int):
        self.sizes = list(range(max_match, min_match - 1, -1))  # longest first
        self.tables: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}
        self.indexed = 1  # n-grams ending before this position have their follower recorded

    def _extend(self, ctx: list[int]) -> None:
        # The n-gram ending at e (exclusive) is followed by ctx[e]: record every e < len(ctx).
        for e in range(self.indexed, len(ctx)):
            for n in self.sizes:
                if e >= n:
                    self.tables[n][tuple(ctx[e - n : e])] = e
        self.indexed = max(self.indexed, len(ctx))

    def propose(self, ctx: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the context's last n-gram."""
        self._extend(ctx)
        L = len(ctx)
        for n in self.sizes:
            if L > n:
                e = self.tables[n].get(tuple(ctx[L - n :]))
                if e is not None:
                    return ctx[e : e + k]
        return []


@dataclass
class RowState:
    """One sequence's speculation state."""

    config: SpeculativeConfig
    index: NgramIndex
    rate: float = 1.0  # recent acceptance rate (exponential average)
    # Acceptance is bursty: the first draft's rate, and a next draft's after an accepted one, apart
    # (spec_policy.run_odds): a copying row's later drafts are worth more than rate^j says.
    first: float = 1.0
    cont: float = 0.9
    rest: int = 0  # steps left without speculation after a run of rejections
    draft_rest: int = 8  # the draft-model method's next rest (doubles while its drafts keep failing)
    proposed: int = 0
    accepted: int = 0


class _PositionSampler:
    """Stands in for a row's :class:`~parallm_engine.sampling.sampler.SeqSampler` at one verified position: the
    same settings, and (seeded rows) the key the row's chain holds after the tokens before it."""

    __slots__ = ("params", "key", "counts", "prompt_ids")

    def __init__(self, params, key):
        self.params, self.key, self.counts, self.prompt_ids = params, key, {}, set()

    def next_key(self):
        self.key, sub = mx.random.split(self.key)
        return sub

    def observe(self, token: int) -> None:
        pass


class Speculator:
    """The scheduler's speculative step (one per scheduler, engine thread only)."""

    def __init__(self, default: SpeculativeConfig | None, stats, context_window: int,
                 max_batch: int = MAX_SPEC_BATCH, token_budget: int = TOKEN_BUDGET):
        self.default = default if default is not None and default.enabled else None
        self.stats = stats
        self.context_window = context_window
        self.max_batch = max_batch
        self.token_budget = token_budget
        self._rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.draft_rows = DraftRows()  # the draft-model method's per-row draft KV (draft_model.py)
        # Steps left before looking for drafts again after a step found none: looking needs the step in
        # flight delivered first, which costs the pipelined overlap when there is nothing to copy.
        self._cooldown = 0
        self.cost = StepCost()  # seconds per step by positions: plain steps (observe_plain_step) and verifies
        self.realized = RealizedGain()  # what speculation delivered vs plain steps, per batch size
        self._width = 1  # this step's forward width, chosen by wants()

    # -- which rows speculate, and how far -----------------------------------------------------
    def config_for(self, seq) -> SpeculativeConfig | None:
        cfg = seq.sampler.params.speculative
        cfg = self.default if cfg is None else cfg
        if cfg is None or not cfg.enabled or seq.sampler.params.needs_penalties:
            return None
        if seq.reasoning is not None and (seq.reasoning.live or (  # its next token may be forced, or its grammar
                seq.constraint is not None and (seq.reasoning.frees_grammar or seq.reasoning.opener() is not None))):
            return None  # waits while it reasons (reasoning_budget)
        if cfg.method == "draft" and seq.request.adapter is not None:  # the draft model drafts for the base only
            return None
        return cfg

    def _state(self, seq, cfg: SpeculativeConfig) -> RowState:
        st = self._rows.get(seq)
        if st is None:
            st = RowState(cfg, NgramIndex(cfg.min_match, cfg.max_match))
            self._rows[seq] = st
        return st

    def wants(self, running: list) -> bool:
        """Whether this step may speculate (checked before the pipelined step in flight is delivered),
        and how wide: the width whose expected tokens per measured second beats a plain step's
        (``spec_policy.choose_width``; adaptive rows), or as wide as their drafts ask (non-adaptive)."""
        self._width = 1
        if not running or len(running) > self.max_batch or self.token_budget // len(running) < 2:
            return False
        rows, fixed = [], 1
        for s in running:
            cfg = self.config_for(s)
            if cfg is None or s.finish_reason is not None:
                rows.append((0.0, 0))
                continue
            st = self._state(s, cfg)
            if not cfg.adaptive:
                fixed = max(fixed, 1 + cfg.num_tokens)
            rows.append((st.first, cfg.num_tokens, st.cont) if st.rest == 0 else (0.0, 0))
        # Adaptive rows speculate as measured costs and their acceptance say, unless speculating has lately
        # delivered less than plain steps for this batch size (spec_policy.RealizedGain).
        adaptive = 1
        if any(row[1] for row in rows) and (fixed > 1 or self.realized.allows(len(running))):
            adaptive = choose_width(self.cost, rows, self.token_budget)
        self._width = min(max(adaptive, fixed), self.token_budget // len(running), MAX_WIDTH)
        return self._width >= 2

    def _idle(self, running: list) -> None:
        """A step in which the batch does not speculate: resting rows count it down, and a row's rate
        (only measured by speculating) drifts back towards a middling estimate, so a row whose text
        turns to copying is tried again."""
        for s in running:
            st = self._rows.get(s)
            if st is None:
                continue
            if st.rest > 0:
                st.rest -= 1
            else:
                if st.rate < _RETRY_RATE:
                    st.rate += (_RETRY_RATE - st.rate) * _RATE_RECOVERY
                if st.first < _RETRY_RATE:
                    st.first += (_RETRY_RATE - st.first) * _RATE_RECOVERY

    def observe_plain_step(self, rows: int, seconds: float) -> None:
        """An ordinary pipelined decode step's rows and seconds (the scheduler's timing, prefill
        excluded); speculative steps time themselves."""
        self.cost.observe_plain(rows, seconds)

    def _k_for(self, seq, st: RowState, cap: int) -> int:
        cfg = st.config
        k = min(cfg.num_tokens, cap)
        if cfg.adaptive and st.rest > 0:
            st.rest -= 1
            return 0
        if seq.max_new is not None:
            k = min(k, seq.max_new - len(seq.output_ids) - 1)  # never verify past max_tokens
        return max(0, min(k, self.context_window - seq.total_len - 1))

    def plan(self, running: list) -> list[list[int]]:
        """Each row's drafted tokens (empty for rows that do not speculate this step)."""
        width = self._width  # positions per row this step, at most (chosen by wants)
        drafts, by_model = [], []
        for s in running:
            cfg = self.config_for(s)
            if cfg is None or s.finish_reason is not None:
                drafts.append([])
                continue
            st = self._state(s, cfg)
            k = self._k_for(s, st, min(MAX_K, width - (s.total_len - s.computed)))
            if cfg.method == "draft" and k > 0:  # a draft model's rows propose together, below
                by_model.append((len(drafts), s, loaded_draft(cfg.draft_key), k))
            draft = st.index.propose(s.request.prompt_ids + s.output_ids, k) if k > 0 and cfg.method == "ngram" else []
            drafts.append(_grammar_cut(s, draft))
        if by_model:  # draft_model.py
            self.draft_rows.retain(running)
            proposed = self.draft_rows.propose([job[1:] for job in by_model])
            for (i, s, _, _), draft in zip(by_model, proposed):
                drafts[i] = _grammar_cut(s, draft)
            self.stats.spec_draft_kv_bytes = self.draft_rows.nbytes()
        return drafts

    def drop(self, seq_ids) -> None:
        """Rows leaving the batch (finished, cancelled, preempted) free their draft-model KV."""
        if len(self.draft_rows):
            self.draft_rows.drop(seq_ids)
            self.stats.spec_draft_kv_bytes = self.draft_rows.nbytes()

    # -- the speculative step ------------------------------------------------------------------
    def step(self, runner) -> bool:
        """Run one speculative decode step if this step should speculate; False to let the decode runner
        run its ordinary step (its pipelined step in flight may have been delivered meanwhile)."""
        running = runner.running
        if not self.wants(running):
            self._idle(running)
            return False
        if self._cooldown:
            self._cooldown -= 1
            return False
        runner.flush()  # proposals need every row's latest token on the host
        running = runner.running
        if not running:
            return True
        t0 = time.perf_counter()  # after the flush: the step in flight it waited for was a plain step
        if self.wants(running):  # again: the flush may have retired rows
            drafts = self.plan(running)
        else:
            self._idle(running)
            drafts = [[] for _ in running]
        if not any(drafts):
            self._cooldown = _COOLDOWN
            return False
        positions, tokens = self.verify(runner, running, drafts)
        seconds = time.perf_counter() - t0
        self.cost.observe(len(running), positions, seconds)
        self.realized.observe(len(running), tokens, seconds, self.cost)
        return True

    def verify(self, runner, running: list, drafts: list[list[int]]) -> tuple[int, int]:
        """One forward over every row's pending context tokens (its last one) and its drafts; accept,
        deliver, roll each row's KV back to what it keeps.
        Returns the positions the forward computed and the tokens delivered."""
        B = len(running)
        pending = [(s.request.prompt_ids + s.output_ids)[s.computed :] for s in running]
        widths = [len(u) + len(d) for u, d in zip(pending, drafts)]
        W = max(widths)
        batch, forwards = runner.batch, runner.forwards
        if len(set(widths)) > 1 and forwards.ragged_ok(runner.model):  # each row computes its own positions only
            logits = forwards.forward_ragged(runner.model, [u + d for u, d in zip(pending, drafts)])
            starts = np.concatenate([[0], np.cumsum(widths)[:-1]]).tolist()
        else:  # a (B, W) rectangle (shorter rows padded with their last token, computed and dropped)
            inputs = [u + d + [u[-1]] * (W - len(u) - len(d)) for u, d in zip(pending, drafts)]
            logits = forwards.forward_block(runner.model, mx.array(inputs))
            logits = logits.reshape(B * W, logits.shape[-1])
            starts, widths = [i * W for i in range(B)], W
        # Sample every verified position as decoding would there: a row's last pending token (the
        # next token's logits) and each of its drafts.
        flat, samplers, constraints, chains, owners, forced, openers = [], [], [], [], [], [], []
        for i, (s, u, d) in enumerate(zip(running, pending, drafts)):
            first = starts[i] + len(u) - 1
            if not d:
                flat.append(first)
                samplers.append(s.sampler)  # its own state: penalties and key chain advance as usual
                constraints.extend(row_grammars([s]))
                forced.extend(forced_rows([s]))
                openers.extend(row_openers([s]))
                chains.append(None)
                owners.append(i)
                continue
            chain = _key_chain(s.sampler, len(d) + 1)
            chains.append(chain)
            masks = _draft_masks(s.constraint, d) if s.constraint is not None else [None] * (len(d) + 1)
            for j in range(len(d) + 1):
                flat.append(first + j)
                samplers.append(_PositionSampler(s.sampler.params, chain[j] if chain else None))
                constraints.append(masks[j])
                forced.append(None)  # a row with drafts neither reasons under a grammar nor has a live budget
                openers.append(None)
                owners.append(i)
        rows = logits[mx.array(flat)]
        if any(c is not None for c in constraints):
            rows = allow_tokens(apply_constraints(rows, constraints), rows, openers)
        rows = force_tokens(rows, forced)
        toks, logprobs = sample_batch(rows, samplers)
        chosen = logprobs[mx.arange(len(flat)), toks] if logprobs is not None else None
        mx.eval([x for x in (toks, logprobs, chosen) if x is not None])
        tok_list = toks.tolist()
        # Accept: a row's tokens up to and including the first that differs from its draft; every row emits
        # its own run (rows keep different numbers of positions: PagedLaneKV.rollback_rows).
        runs, starts, pos = [], [], 0
        for d in drafts:
            n = 1
            while n <= len(d) and tok_list[pos + n - 1] == d[n - 1]:
                n += 1
            runs.append(min(n, len(d) + 1))
            starts.append(pos)
            pos += len(d) + 1
        emit: list[int] = []
        for r, start in zip(runs, starts):
            emit.extend(range(start, start + r))
        before = [len(s.output_ids) for s in running]
        lp_rows = None
        if logprobs is not None:
            lp_idx = [p for p in emit if running[owners[p]].logprobs is not None]
            lp_rows = logprobs[mx.array(lp_idx)] if lp_idx else None
        sel = mx.array(emit)
        runner.out.deliver([running[owners[p]] for p in emit], toks[sel], lp_rows,
                          chosen[sel] if chosen is not None else None)
        self.stats.decode_steps += 1
        if any(drafts):
            self.stats.spec_steps += 1
        # Row i's KV is right for its pending tokens and the drafts it emitted (all but the token it emitted
        # last): it keeps those positions and forgets the rest of its W.
        # A row that finished in this delivery (a stop, its last token) is retired after the step; its KV
        # past what it emitted is never read and never reaches the prefix cache.
        keep = []
        for i, (s, u, d) in enumerate(zip(running, pending, drafts)):
            added = len(s.output_ids) - before[i]
            keep.append(len(u) + max(0, added - 1))
            if d:
                self._account(s, len(d), max(0, min(added - 1, len(d))), chains[i])
        batch.rollback_rows(widths, keep)
        for s, k in zip(running, keep):
            s.computed += k
        return (B * W if isinstance(widths, int) else sum(widths)), len(emit)

    def _account(self, s, proposed: int, accepted: int, chain) -> None:
        if chain:  # the row's key chain moves on by the tokens it emitted
            s.sampler.key = chain[min(accepted + 1, len(chain) - 1)]
            s.sampler.draws = len(s.output_ids)  # one draw per token emitted (SeqSampler.rewind_to)
        st = self._rows.get(s)
        if st is not None:
            st.proposed += proposed
            st.accepted += accepted
            st.rate = 0.7 * st.rate + 0.3 * (accepted / proposed)
            st.first = 0.7 * st.first + 0.3 * (accepted > 0)
            trials = accepted - 1 + (accepted < proposed)  # drafts tried after an accepted one
            if accepted and trials:
                st.cont = 0.7 * st.cont + 0.3 * ((accepted - 1) / trials)
            if st.config.adaptive and st.rate < _MIN_RATE:
                st.rest, st.rate = _REST, 0.5  # rest, then try again from a middling estimate
                if st.config.method == "draft":  # drafting costs forwards: retry with one token, rest longer
                    st.rest, st.rate = st.draft_rest, 0.2
                    st.draft_rest = min(2 * st.draft_rest, _MAX_DRAFT_REST)
                st.first = st.rate
            elif st.rate >= 0.5:
                st.draft_rest = _REST
        usage = s.request.usage
        usage.spec_proposed_tokens += proposed
        usage.spec_accepted_tokens += accepted
        self.stats.spec_proposed_tokens += proposed
        self.stats.spec_accepted_tokens += accepted


MAX_K = 16


def _grammar_cut(seq, draft: list[int]) -> list[int]:
    """Drafted tokens the row's grammar forbids are cut (with everything after them) before verifying."""
    if draft and seq.constraint is not None:
        draft = draft[: seq.constraint.matcher.validate_tokens(draft)]
    return draft


class _FixedMask:
    """A grammar's allowed-token bitmask at one verified position, computed ahead (for apply_constraints)."""

    def __init__(self, words: int, bits: np.ndarray):
        self.words, self.bits = words, bits

    def fill_bitmask(self, row: np.ndarray) -> None:
        row[:] = self.bits


def _draft_masks(constraint, draft: list[int]) -> list[_FixedMask]:
    """The grammar's masks after 0 .. len(draft) drafted tokens (all valid: ``plan`` cut the rest); the
    matcher is rolled back to where it was (the tokens actually emitted advance it when delivered)."""
    masks = []
    for j in range(len(draft) + 1):
        bits = np.empty(constraint.words, dtype=np.int32)
        constraint.fill_bitmask(bits)
        masks.append(_FixedMask(constraint.words, bits))
        if j < len(draft):
            constraint.advance(draft[j])
    constraint.matcher.rollback(len(draft))
    return masks


def _key_chain(sampler, n: int) -> list | None:
    """A seeded, sampled row's key after 0 .. n draws (``SeqSampler.next_key`` keeps the first half
    of each split); None for rows that draw no keys (greedy, unseeded)."""
    if sampler.key is None or sampler.params.greedy:
        return None
    chain = [sampler.key]
    for _ in range(n):
        chain.append(mx.random.split(chain[-1])[0])
    return chain
