"""The scheduler's prefill planning: which prompt tokens run in this step.

Part of the scheduler (``Scheduler`` takes it in): it plans and runs nothing. The step's work items
(``step_plan.PrefillWork``) are all planned before any runs, within a token budget the measured prefill
rate and the step-time target set (``Scheduler.prefill_token_budget`` and ``_prefill_room_s``; the runner
also stops at the plan's deadline). A context longer than one chunk is prefilled alone, chunk by chunk,
across steps, at the step-time target's pace; shorter ones (attention layout) together in groups of at most
one chunk of tokens, a whole chunk a step whatever the pace (a short job goes first, also past a long prompt
at the head of the queue, which still advances every step: ``_shorts_first``); on an idle engine a burst of
short prompts is prefilled whole in one step; a context the prefix cache holds whole needs no forward. A
prompt whose uncached prefix another prompt of the step computes waits for the next step and finds it in the
radix tree (in-flight dedup). While rows decode, every item the runner can compute so is marked ``fused``:
the decode forward computes it (``kv.fused_step``), and the prompts it finishes join the decode rows of that
same forward; a fused chunk that leaves its prompt unfinished is the step's last item. Where the runner has
several prefill streams (a multi-core CPU on MLX's ops), only the step's last item is fused (``_fuses``).
Embedding texts beside decoding rows come after the chat prompts and spend a credit of their own
(``_embedding_budget``): where the chat prompts used the step's budget before reaching them, a second pass
plans the texts alone.
"""

from __future__ import annotations

import time
from dataclasses import replace

from parallm_engine.embed import embedding
from parallm_engine.core.sequence import Sequence
from parallm_engine.kv.radix_cache import shared_context_len
from parallm_engine.runner.step_plan import PrefillWork

#: Embedding tokens a step earns beside decoding rows however slow the machine (a prompt's floor,
#: ``min_prefill_tokens``, is larger: a stream waits behind it; nobody streams an embedding).
EMBEDDING_MIN_TOKENS = 16
#: The share of the rest of the step's time the texts beside decoding rows take on average: under 1 because
#: the rate is an average and their forward is a second one. (Spent a few tokens every step, as it once was,
#: the texts ran in 16-token chunks through the paged path, each chunk's forward costing more than the decode
#: step: the streams' inter-token latency more than doubled; docs/embeddings.md, "The grouped bucket".)
EMBEDDING_STEP_SHARE = 0.6
#: The texts beside decoding rows run as a group once their credit holds it: at most what this many steps earn
#: (and at most a chunk), so one step in a few takes them and the group's spike stays a few steps' worth.
EMBEDDING_GROUP_STEPS = 4
#: An embedding group's forward is one right-padded rectangle (rows x its longest text): where nothing decodes,
#: a text joins only while at least this share of the rectangle is real tokens. Texts of other lengths wait for
#: a group of their own (on a CPU the padding's attention and MLP cost more than a bigger batch saves).
EMBEDDING_FILL = 0.8


class PrefillPlanner:
    """Mixed into ``Scheduler``: uses its queues (``waiting``, ``prefilling``, ``running``), ``config``,
    ``kv`` (the KV cache manager), ``out`` and ``stats``."""

    _embed_credit: float = 0.0  # embedding tokens earned beside decoding rows, not yet spent (_embedding_budget)

    def _start_prefill(self, seq: Sequence) -> None:
        """Look the context up in the prefix cache and pin what matched until the prefill is done."""
        self.kv.match(seq)
        if self.kv.has_snapshots and not seq.embedding:
            seq.split = self._shared_boundary(seq, seq.prefill_ids)
        seq.started = True

    def _shared_boundary(self, seq: Sequence, ids: list[int]) -> int:
        """Mixed layout: the longest prefix ``seq`` shares with another queued prompt, past what is
        cached: the first chunk stops there and snapshots it, so the others restore it instead of
        recomputing it (in-flight dedup, and the next wave's hit)."""
        best = 0
        for other in list(self.waiting) + list(self.prefilling):
            if other is seq or other.embedding:  # embedding rows read no snapshot
                continue
            best = max(best, shared_context_len(seq, other))
        return best if seq.cached_tokens + 8 < best < len(ids) else 0

    def _finishes_in(self, seq: Sequence, tokens: int, peeked: int | None = None) -> bool:
        """Whether ``seq``'s whole prefill, from what the prefix cache held, is at most ``tokens``: a short
        prompt (a long one's last chunk is not: it attends over the whole context, so it costs more).
        ``peeked``: ``kv.peek(seq)`` where the caller already has it (used only while ``seq`` is not started)."""
        if seq.started:
            cached = seq.cached_tokens
        else:
            cached = self.kv.peek(seq) if peeked is None else peeked
        return len(seq.prefill_ids) - cached <= tokens

    def _uncached_overlap(self, seq: Sequence, group: list[Sequence], cached: int) -> bool:
        """Would ``seq`` recompute new tokens another group member is about to compute? Then it waits
        one step and finds them in the radix tree (in-flight dedup of a shared uncached prefix)."""
        if not self.kv.has_tree or seq.embedding:
            return False
        return any(shared_context_len(seq, g) > cached + 8 for g in group if not g.embedding)

    def _plan_prefill(self) -> tuple[tuple[PrefillWork, ...], float | None]:
        """The step's prefill work, complete before any of it runs, and the time after which the runner
        starts no further item. Up to ``prefill_token_budget`` context tokens: a context longer than one
        chunk alone, chunk by chunk, across steps; shorter ones (attention layout) together in forward
        passes (groups) of at most one chunk of tokens. A prompt whose uncached prefix another prompt of the
        step computes is not planned in this step: the next step finds that prefix in the radix tree.
        Sequences whose context is all cached need no forward."""
        budget = self.prefill_token_budget()
        whole = min(self.config.prefill_chunk, self.config.prefill_budget)
        owed = self._shorts_first(whole)  # the long prompt short ones went ahead of: it still advances
        # Embedding texts are bulk work with no stream behind them: a burst of them (a corpus being indexed)
        # takes the paced budget next to decoding rows, never a whole chunk each step (that starves them).
        prompts = [s for s in self.prefilling if not s.embedding]
        burst = len(prompts) > len(self.running)
        if burst or (prompts and self._finishes_in(prompts[0], whole)):
            # Nothing decoding, a burst (more prompts waiting for their first token than streams
            # waiting for their next), or a short prompt (one chunk is its whole prefill): a whole chunk
            # this step. A short job goes first: the running streams pay its prefill now or over the
            # next steps alike, while it (and every prompt behind it) waits less. Only a prompt longer
            # than a chunk is spread over steps at the step-time target's pace.
            budget = max(budget, whole)
        chunk = min(self.config.prefill_chunk, budget)
        # The token budget follows the measured rate; the clock also stops the step's prefill once the
        # target has passed (a rate measured on an idle machine may not hold on a busy one): the runner
        # starts no item after the deadline.
        deadline = time.perf_counter() + self._prefill_room_s() if self.config.step_time_target_s else None
        idle_burst = self._idle_burst_tokens(whole)
        if idle_burst:
            # Nothing decodes: no stream waits on this step, so the whole burst of short prompts is
            # prefilled now and they decode together from the next forward on, as BatchGenerator does
            # (paced, each later wave would pay the decode steps of the waves before it).
            budget, deadline = max(budget, idle_burst), None
        step = _PlannedStep(decoding=bool(self.running))
        embed_capped = not self.running  # embedding texts beside decoding rows: capped once reached
        texts_from = None  # the texts' budget beside decoding rows, once they got one
        if self.running and prompts and len(prompts) < len(self.prefilling):
            # Prompts with a stream behind them go before embedding texts (bulk work) queued ahead of them.
            self._texts_to_front(back=True)
        texts_pass = False  # a second pass for embedding texts the chat prompts ahead of them left unplanned
        while True:
            while self.prefilling:
                if owed is not None and owed not in self.prefilling:
                    owed = None  # a short prompts' group took its last tokens
                if owed is not None and (budget <= 0 or self.prefilling[0] is owed):
                    # The short prompts went ahead of it, not instead of it: it gets what they left of the
                    # step's budget and at least the minimum progress, so a stream of short prompts never
                    # starves it (its full paced share on top of theirs would double the running streams' step).
                    self.prefilling.remove(owed)
                    self.prefilling.appendleft(owed)
                    budget, owed = max(budget, self.config.min_prefill_tokens), None
                elif budget <= 0 and (embed_capped or not self.prefilling[0].embedding):
                    break  # (embedding texts beside decoding rows spend their own credit, below)
                head = self.prefilling[0]
                if texts_pass and not head.embedding:
                    break  # the texts pass ends at the chat prompts
                if head.embedding and not embed_capped:
                    # What is left is embedding texts (they come last): while rows decode they get what they
                    # have earned (_embedding_budget), so a corpus being embedded does not double the streams'
                    # steps. A text longer than a group is prefilled over steps (its pooled state accumulates).
                    budget, embed_capped = self._embedding_budget(), True
                    if budget <= 0:
                        break
                    chunk, texts_from = min(self.config.prefill_chunk, budget), budget
                if not head.started:
                    if self._uncached_overlap(head, step.computing, self.kv.peek(head)):
                        break  # it would recompute what this step computes: next step, from the tree
                    self._start_prefill(head)
                remaining = len(head.prefill_ids) - step.pos(head)
                if remaining == 0 and not step.opened(head):
                    self.prefilling.popleft()
                    step.add(PrefillWork("cached", (head,), (0,), finishes=(head,)))
                    continue
                if self.kv.prefills_alone or step.opened(head) or remaining > chunk:
                    seqs = [head, *self._parallel_chunks(head, chunk, step)]
                    per = max(1, min(chunk, budget // len(seqs)))  # budget > 0: one sequence gets min(chunk, budget)
                    new = tuple(self._chunk_len(s, step.pos(s), per) for s in seqs)
                    finishes = tuple(s for s, n in zip(seqs, new) if step.pos(s) + n == len(s.prefill_ids))
                    work = PrefillWork("chunk", tuple(seqs), new, finishes=finishes)
                    work = replace(work, fused=self._fuses(work, budget, step))
                    step.add(work)
                    for s in finishes:
                        self.prefilling.remove(s)
                    if work.fused and len(finishes) < len(seqs):
                        break  # a prompt runs once a step: its next chunk is the next step's
                    if any(s.split and step.pos(s) == s.split for s in seqs):
                        break  # a shared prefix's snapshot is taken after the step (Scheduler.update)
                    budget -= work.n_tokens
                    continue
                group, used, widest = [head], remaining, remaining
                for seq in list(self.prefilling)[1:]:
                    if len(group) >= self.config.max_batch_size:
                        break
                    if step.opened(seq) or (seq.embedding and not embed_capped and not head.embedding) or \
                            (texts_pass and not seq.embedding):
                        continue  # (embedding texts beside decoding rows: their own budget, their own pass)
                    cached = seq.computed if seq.started else self.kv.peek(seq)
                    left = len(seq.prefill_ids) - cached
                    if left == 0 or used + left > min(chunk, budget):
                        continue
                    if head.embedding and seq.embedding and not self.running and \
                            used + left < EMBEDDING_FILL * (len(group) + 1) * max(widest, left):
                        # mostly padding: a text of another length waits for texts like it (not beside decoding
                        # rows: there the texts' capped budget would chunk the texts left out into more forwards)
                        continue
                    if not self._joins(seq, group, cached, step):
                        continue
                    widest = max(widest, left)
                    group.append(seq)
                    used += len(seq.prefill_ids) - seq.computed
                for seq in group:
                    self.prefilling.remove(seq)
                work = PrefillWork("group", tuple(group), tuple(len(s.prefill_ids) - s.computed for s in group),
                                   finishes=tuple(group))
                step.add(replace(work, fused=self._fuses(work, budget, step)))
                budget -= used
            if texts_pass or not self._texts_left_unplanned(embed_capped):
                break
            # Beside decoding rows the texts spend their own credit: a long chat prompt that takes every
            # step's budget (prefilled in chunks over many steps) does not hold them back until it is done.
            texts_pass, owed = True, None
            self._texts_to_front()
        if texts_pass:
            self._texts_to_front(back=True)
        if texts_from is not None:  # what the texts planned comes out of their credit
            self._embed_credit = max(0.0, self._embed_credit - (texts_from - max(budget, 0)))
        return tuple(step.items), deadline

    def _embedding_budget(self) -> int:
        """Prefill tokens of embedding texts this step may spend beside decoding rows, from a token bucket:
        each step earns ``EMBEDDING_STEP_SHARE`` of what the rest of the step takes at the measured rate (at
        least ``EMBEDDING_MIN_TOKENS``), and the texts run once the credit holds the next group of them whole
        (``_next_text_group``): one forward without KV (``runner/forward.texts``) in one step of a few, rather
        than a small chunk every step, each costing a forward's fixed overhead. What they spend is what they
        earned, also where chat prompts finished before them took the step's paced budget (not slivers of what
        the prompts left). The credit never exceeds that group (or one step's earning): no burst after a quiet
        spell. 0: not this step."""
        if self._prefill_rate is None:
            return EMBEDDING_MIN_TOKENS  # not measured yet: a small chunk, then the rate is known
        earned = max(EMBEDDING_MIN_TOKENS, EMBEDDING_STEP_SHARE * self._other_step_s * self._prefill_rate)
        need = self._next_text_group(min(self.config.prefill_chunk, int(EMBEDDING_GROUP_STEPS * earned)))
        self._embed_credit = min(self._embed_credit + earned, max(need, earned))
        return int(self._embed_credit) if self._embed_credit >= need else 0

    def _texts_left_unplanned(self, embed_capped: bool) -> bool:
        """Rows decode, embedding texts wait, and the step's prefill stopped at a chat prompt before them
        (beside decoding rows no text is planned before ``embed_capped``: none rides in a chat prompt's item)."""
        return bool(self.running) and not embed_capped and any(s.embedding for s in self.prefilling)

    def _texts_to_front(self, back: bool = False) -> None:
        """The embedding texts first in ``prefilling`` (``back``: last again, after the chat prompts), each
        group in its order."""
        texts = [s for s in self.prefilling if s.embedding]
        prompts = [s for s in self.prefilling if not s.embedding]
        self.prefilling.clear()
        self.prefilling.extend(prompts + texts if back else texts + prompts)

    def _next_text_group(self, cap: int) -> int:
        """The prefill tokens of the embedding texts next in the queue that fit whole in ``cap`` tokens (at
        most ``max_batch_size`` of them), or ``cap`` where the first is longer (it runs in chunks of that)."""
        need = n = 0
        for seq in self.prefilling:
            if not seq.embedding:
                continue
            left = len(seq.prefill_ids) - seq.computed
            if need + left > cap or n >= self.config.max_batch_size:
                break
            need, n = need + left, n + 1
        return need or max(cap, 1)

    def _idle_burst_tokens(self, whole: int) -> int:
        """Where no row decodes and nothing is in flight: the uncached tokens of the prefilling prompts
        whose whole prefill is one chunk (``whole`` tokens) at most, up to one ``max_batch_size`` of them;
        0 otherwise (rows decoding: the step-time target paces the prefill next to them)."""
        if self.running or self.runner.in_flight or len(self.prefilling) < 2:
            return 0
        total = 0
        for seq in list(self.prefilling)[: self.config.max_batch_size]:
            cached = seq.computed if seq.started else self.kv.peek(seq)
            if len(seq.prefill_ids) - cached <= whole:
                total += len(seq.prefill_ids) - cached
        return total

    def _shorts_first(self, whole: int) -> Sequence | None:
        """Shortest job first, where a long prompt heads the queue: prompts whose whole prefill is one chunk
        (``whole`` tokens, from what the prefix cache holds) go ahead of it, up to one chunk of them a step,
        and take that chunk in this step (as a short head does). A long prompt is paced at the step-time
        target over many steps; behind it a short prompt would wait for all of them (vLLM's partial
        prefills let short prompts jump the queue in the same way). Not a short prompt that would
        recompute an uncached prefix a prompt ahead of it is computing (it finds that in the radix tree
        later), nor one less urgent by priority than the head. Only past a head with at least two chunks
        of prefill left (a document, not a turn just over a chunk), and it lets through at most its own
        length in short prompts' tokens (``Sequence.overtaken``): then they wait for it, so its prefill
        takes at most about twice its own work, whatever keeps arriving (its effect on the agents
        trace: docs/benchmarks-archive.md, "Short prompts first"). Returns the head
        they went ahead of (``_plan_prefill`` still gives it what they left of the budget, at least
        ``min_prefill_tokens``), or None."""
        if len(self.prefilling) < 2:
            return None
        head = self.prefilling[0]
        n, cached = len(head.prefill_ids), head.cached_tokens if head.started else self.kv.peek(head)
        if n - max(head.computed, cached) < 2 * whole:  # also every head that _finishes_in one chunk
            return None  # a chunk or two left: the short prompts wait those steps
        room = min(whole, n - cached - head.overtaken)  # short prompts' tokens that may still go ahead of it
        if room <= 0:
            return None
        ahead: list[Sequence] = []
        behind: list[Sequence] = [head]
        used = 0
        for seq in list(self.prefilling)[1:]:
            n = len(seq.prefill_ids)
            cached = seq.computed if seq.started else self.kv.peek(seq)
            if (self._finishes_in(seq, whole, peeked=cached) and seq.request.priority <= head.request.priority
                    and used + n - cached <= room and not self._uncached_overlap(seq, [*behind, *ahead], cached)):
                ahead.append(seq)
                used += n - cached
            else:
                behind.append(seq)
        if not ahead:
            return None
        head.overtaken += used
        self.prefilling.clear()
        self.prefilling.extend(ahead + behind)
        return head

    def _fuses(self, work: PrefillWork, budget: int, step: "_PlannedStep") -> bool:
        """Whether ``work`` runs in this step's decode forward (``kv.fused_step``): rows decode this step
        (running ones, or prompts an earlier item finishes), the KV takes ragged steps, and the runner can
        run each of its prompts so. Where the runner has several prefill streams (a multi-core CPU without
        the native kernels, each stream on one core), only the step's last item, of one prompt: a prefill
        forward before it runs on one core while the step in flight decodes on the other, and a group is
        split over both cores."""
        if not self.config.fuse_prefill or not step.decoding or not self.kv.takes_ragged_steps:
            return False
        if self.runner.prefill_streams > 1:
            others = any(s not in work.seqs for s in self.prefilling)
            last = work.n_tokens >= budget or (len(work.finishes) == len(work.seqs) and not others)
            if len(work.seqs) > 1 or not last:
                return False
        return all(self.runner.fuses(s) for s in work.seqs)

    def _parallel_chunks(self, head: Sequence, chunk: int, step: "_PlannedStep") -> list[Sequence]:
        """Long contexts whose chunks run beside ``head``'s, one per further prefill stream of the runner
        (a multi-lane CPU without the native kernels runs each lane's forward on its own core): those
        prefilling in chunks already, and waiting ones longer than a chunk whose uncached prefix no chosen
        one is computing (that one waits for the radix tree, as in a group)."""
        streams = self.runner.prefill_streams
        if streams <= 1 or self.kv.prefills_alone or head.embedding:
            return []  # (an embedding text's chunk runs alone: the chat prompts behind it have their own pass)
        chosen: list[Sequence] = []
        for seq in list(self.prefilling)[1:]:
            if len(chosen) + 1 >= streams:
                break
            if seq.embedding:
                continue
            cached = step.pos(seq) if seq.started else self.kv.peek(seq)
            if not step.opened(seq) and len(seq.prefill_ids) - cached <= chunk:
                continue  # short: a group's
            if self._joins(seq, [head, *chosen], cached, step):
                chosen.append(seq)
        return chosen

    def _joins(self, seq: Sequence, others: list[Sequence], cached: int, step: "_PlannedStep") -> bool:
        """Whether ``seq`` may prefill in the same step as ``others`` (``cached``: its tokens the prefix cache
        holds): not if it would recompute an uncached prefix one of them, or another item of the step, is
        computing. Started here if so."""
        if seq.started:
            return True
        if self._uncached_overlap(seq, [*others, *step.computing], cached):
            return False
        self._start_prefill(seq)
        return True

    @staticmethod
    def _chunk_len(seq: Sequence, pos: int, n_max: int) -> int:
        """The next chunk of ``seq``'s context from ``pos``: at most ``n_max`` tokens, ending at its split if
        it has one."""
        end = min(len(seq.prefill_ids), pos + n_max)
        if seq.split and pos < seq.split < end:
            end = seq.split
        return end - pos

    def _prompts_done(self, seqs: list[Sequence]) -> None:
        """After the step: contexts prefilled (all but their last token), whose rows the runner joined to the
        batch (and counted in the usage). Embedding rows are delivered here and go no further
        (``embedding.finish_embeddings``); the others are unpinned."""
        for seq in seqs:
            if seq.embedding:  # delivered here: its KV (and the row holding it) goes
                self.kv.release(seq)
        for seq in embedding.finish_embeddings(seqs, self.out, self.stats):
            self.kv.unpin(seq)


class _PlannedStep:
    """The prefill planned so far in one step: its items, where each sequence's context will be once they
    have run, and which sequences compute context tokens (a prompt continuing one of those waits a step)."""

    def __init__(self, decoding: bool):
        self.items: list[PrefillWork] = []
        self.computing: list[Sequence] = []
        self.decoding = decoding  # rows decode this step: running ones, or prompts an item finishes
        self._at: dict[int, int] = {}

    def pos(self, seq: Sequence) -> int:
        return self._at.get(id(seq), seq.computed)

    def opened(self, seq: Sequence) -> bool:
        """``seq`` has its prefill row (or caches): from an earlier step, or a chunk planned in this one."""
        return seq.cache is not None or id(seq) in self._at

    def add(self, work: PrefillWork) -> None:
        self.items.append(work)
        for seq, n in zip(work.seqs, work.new):
            self._at[id(seq)] = self.pos(seq) + n
            if n:
                self.computing.append(seq)
        if any(not s.embedding for s in work.finishes):
            self.decoding = True
