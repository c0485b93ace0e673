"""The scheduler's prefill planning: which prompt tokens run in this step, one work item at a time.

Part of the scheduler (``Scheduler`` takes it in): it plans and runs nothing. Each item
(``step_plan.PrefillWork``) is planned once the one before has run, because what comes next depends on
it: the step's prefill stops on the clock (``Scheduler.prefill_token_budget`` and ``_prefill_room_s``
set its token budget and time), and a prompt whose uncached prefix a member of the step's group is
computing waits one step and finds it in the radix tree (in-flight dedup). A context longer than one
chunk is prefilled alone, chunk by chunk, across steps, at the step-time target's pace; shorter ones
(attention layout) together in groups of at most one chunk of tokens, a whole chunk a step whatever the
pace (a short job goes first, also past a long prompt at the head of the queue, which still advances every
step: ``_shorts_first``); a context the prefix cache holds whole needs no forward. While rows
decode, every item the runner can compute so is marked ``fused``: the decode forward computes it
(``kv.fused_step``), and the prompts it finishes join the decode rows of that same forward. The radix tree
takes those prompts once that forward is built, so a later item of the step never reads them: an item
whose uncached prefix a waiting prompt continues runs as a prefill forward instead (the tree holds it at
once, and the other finds it there in this same step), and a fused chunk that leaves its prompt unfinished
is the step's last item. Where the runner has several prefill streams (a multi-core CPU on MLX's ops), only
the step's last item is fused (see ``_fuses``).
"""

from __future__ import annotations

import time

from parallm_engine.embed import embedding
from parallm_engine.core.sequence import Sequence
from parallm_engine.kv.radix_cache import shared_context_len
from parallm_engine.runner.step_plan import PrefillWork, StepPlan


class PrefillPlanner:
    """Mixed into ``Scheduler``: uses its queues (``waiting``, ``prefilling``, ``running``), ``config``,
    ``kv`` (the KV cache manager), ``out`` and ``stats``."""

    def _start_prefill(self, seq: Sequence) -> None:
        """Look the context up in the prefix cache and pin what matched until the prefill is done."""
        self.kv.match(seq)
        if self.kv.has_snapshots and not seq.embedding:
            seq.split = self._shared_boundary(seq, seq.prefill_ids)
        seq.pos = seq.cached_tokens
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

    def _plan_prefill(self, plan: StepPlan):
        """Spend up to ``prefill_budget`` context tokens this step, one work item at a time (each planned
        once the one before has run). A context longer than one chunk is prefilled alone, chunk by
        chunk, across steps; shorter ones (attention layout) together in forward passes (groups) of at
        most one chunk of tokens, except those whose uncached prefix a group member is computing.
        Sequences whose context is all cached need no forward."""
        budget = self.prefill_token_budget()
        whole = min(self.config.prefill_chunk, self.config.prefill_budget)
        owed = self._shorts_first(whole)  # the long prompt short ones went ahead of: it still advances
        burst = len(self.prefilling) > len(self.running)
        if burst or (self.prefilling and self._finishes_in(self.prefilling[0], whole)):
            # Nothing decoding, a burst (more prompts waiting for their first token than streams
            # waiting for their next), or a short prompt (one chunk is its whole prefill): a whole chunk
            # this step. A short job goes first: the running streams pay its prefill now or over the
            # next steps alike, while it (and every prompt behind it) waits less. Only a prompt longer
            # than a chunk is spread over steps at the step-time target's pace.
            budget = max(budget, whole)
        chunk = min(self.config.prefill_chunk, budget)
        # The token budget follows the measured rate; the clock also stops the step's prefill once the
        # target has passed (a rate measured on an idle machine may not hold on a busy one).
        deadline = time.perf_counter() + self._prefill_room_s() if self.config.step_time_target_s else None
        self._fused_seqs = []  # prompts this step's decode forward computes (not in the tree until it is built)
        while self.prefilling:
            out_of_room = budget <= 0 or (deadline is not None and time.perf_counter() >= deadline)
            if owed is not None and owed not in self.prefilling:
                owed = None  # a short prompts' group took its last tokens
            if owed is not None and (out_of_room or self.prefilling[0] is owed):
                # The short prompts went ahead of it, not instead of it: it gets what they left of the
                # step's budget and at least the minimum progress, so a stream of short prompts never
                # starves it (its full paced share on top of theirs would double the running streams' step).
                self.prefilling.remove(owed)
                self.prefilling.appendleft(owed)
                budget, owed = max(budget, self.config.min_prefill_tokens), None
            elif out_of_room:
                break
            head = self.prefilling[0]
            if not head.started:
                if self._fused_seqs and self._uncached_overlap(head, self._fused_seqs, self.kv.peek(head)):
                    return  # it would recompute what the decode forward computes: next step, from the tree
                self._start_prefill(head)
            remaining = len(head.prefill_ids) - head.pos
            if remaining == 0 and head.cache is None:
                self.prefilling.popleft()
                work = PrefillWork("cached", [head], 0)
                yield work
                self._prompts_done(work.finished, plan.joined)
                continue
            if self.layout == "mixed" or head.cache is not None or remaining > chunk:
                seqs = [head, *self._parallel_chunks(head, chunk)]
                per = max(1, min(chunk, budget // len(seqs)))  # budget > 0: one sequence gets min(chunk, budget)
                new = [self._chunk_len(s, per) for s in seqs]
                work = PrefillWork("chunk", seqs, sum(new), new=new)
                work.fused = self._fuses(work, budget)
                yield work
                for s in seqs:
                    self.kv.commit_split(s)
                for s, _ in work.finished:
                    self.prefilling.remove(s)
                if work.finished:
                    self._prompts_done(work.finished, plan.joined, work.fused)
                if work.fused:
                    self._fused_seqs += seqs
                    if len(work.finished) < len(seqs):
                        return  # a prompt runs once a step: its next chunk is the next step's
                budget -= work.n_tokens
                continue
            group, used = [head], remaining
            for seq in list(self.prefilling)[1:]:
                if len(group) >= self.config.max_batch_size:
                    break
                if seq.cache is not None:
                    continue
                cached = seq.pos if seq.started else self.kv.peek(seq)
                left = len(seq.prefill_ids) - cached
                if left == 0 or used + left > min(chunk, budget) or not self._joins(seq, group, cached):
                    continue
                group.append(seq)
                used += len(seq.prefill_ids) - seq.pos
            for seq in group:
                self.prefilling.remove(seq)
            work = PrefillWork("group", group, used)
            work.fused = self._fuses(work, budget)
            yield work
            self._prompts_done(work.finished, plan.joined, work.fused)
            if work.fused:
                self._fused_seqs += group
            budget -= used

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
        takes at most about twice its own work, whatever keeps arriving. Measured on the default agents
        trace (turns of 200-800 new tokens, half of them just over a chunk): past every long head, the short
        turns' TTFT p50 fell 2.5x and the long ones' rose 1.6x (TTFT p99 69-76 -> 105-129 s on the
        pure-MLX path); with two chunks as the threshold the rule stays out of that trace. Returns the head
        they went ahead of (``_plan_prefill`` still gives it what they left of the budget, at least
        ``min_prefill_tokens``), or None."""
        if len(self.prefilling) < 2:
            return None
        head = self.prefilling[0]
        n, cached = len(head.prefill_ids), head.cached_tokens if head.started else self.kv.peek(head)
        if n - max(head.pos, cached) < 2 * whole:  # also every head that _finishes_in one chunk
            return None  # a chunk or two left: the short prompts wait those steps, as before
        room = min(whole, n - cached - head.overtaken)  # short prompts' tokens that may still go ahead of it
        if room <= 0:
            return None
        ahead: list[Sequence] = []
        behind: list[Sequence] = [head]
        used = 0
        for seq in list(self.prefilling)[1:]:
            n = len(seq.prefill_ids)
            cached = seq.pos if seq.started else self.kv.peek(seq)
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

    def _fuses(self, work: PrefillWork, budget: int) -> bool:
        """Whether ``work`` runs in this step's decode forward (``kv.fused_step``): rows decode this step, no
        waiting prompt continues a prompt it finishes (run now, the tree holds that prompt for them in this
        same step; fused, they would wait a step), and the runner can run each of its prompts so. Where the
        runner has several prefill streams (a multi-core CPU without the native kernels, each stream on one
        core), only the step's last item, of one prompt: a prefill forward before it runs on one core while
        the step in flight decodes on the other, and a group is split over both cores."""
        if not self.config.fuse_prefill or not self.running or self.layout != "attention":
            return False
        done = work.seqs if work.kind == "group" else \
            [s for s, n in zip(work.seqs, work.new) if s.pos + n == len(s.prefill_ids)]  # into the tree now
        if self.runner.prefill_streams > 1:
            others = any(s not in work.seqs for s in self.prefilling)
            last = work.n_tokens >= budget or (len(done) == len(work.seqs) and not others)
            if len(work.seqs) > 1 or not last:
                return False
        if self.kv.has_tree and any(not o.started and not o.embedding and o not in work.seqs
                                    and shared_context_len(o, s) > s.pos + 8
                                    for o in self.prefilling for s in done):
            return False
        return all(self.runner.fuses(s) for s in work.seqs)

    def _parallel_chunks(self, head: Sequence, chunk: int) -> list[Sequence]:
        """Long contexts whose chunks run beside ``head``'s, one per further prefill stream of the runner
        (a multi-lane CPU without the native kernels runs each lane's forward on its own core): those
        prefilling in chunks already, and waiting ones longer than a chunk whose uncached prefix no chosen
        one is computing (that one waits for the radix tree, as in a group)."""
        streams = self.runner.prefill_streams
        if streams <= 1 or self.layout == "mixed":
            return []
        chosen: list[Sequence] = []
        for seq in list(self.prefilling)[1:]:
            if len(chosen) + 1 >= streams:
                break
            if seq.embedding:
                continue
            cached = seq.pos if seq.started else self.kv.peek(seq)
            if seq.cache is None and len(seq.prefill_ids) - cached <= chunk:
                continue  # short: a group's
            if self._joins(seq, [head, *chosen], cached):
                chosen.append(seq)
        return chosen

    def _joins(self, seq: Sequence, others: list[Sequence], cached: int) -> bool:
        """Whether ``seq`` may prefill in the same step as ``others`` (``cached``: its tokens the prefix cache
        holds): not if it would recompute an uncached prefix one of them, or a prompt this step's decode forward
        computes, is computing. Started here if so."""
        if seq.started:
            return True
        if self._uncached_overlap(seq, [*others, *self._fused_seqs], cached):
            return False
        self._start_prefill(seq)
        return True

    @staticmethod
    def _chunk_len(seq: Sequence, n_max: int) -> int:
        """The next chunk of ``seq``'s context: at most ``n_max`` tokens, ending at its split if it has one."""
        end = min(len(seq.prefill_ids), seq.pos + n_max)
        if seq.split and seq.pos < seq.split < end:
            end = seq.split
        return end - seq.pos

    def _prompts_done(self, finished: list[tuple[Sequence, list]], done: list[Sequence], fused: bool = False) -> None:
        """Contexts prefilled (all but their last token): the KV cache manager stores them in the prefix
        cache and hands them to the decode batch. Embedding rows are delivered here and go no further
        (``embedding.finish_embeddings``). ``fused``: their KV is written by this step's decode forward,
        which they join (``kv.fused_step``)."""
        for seq, _ in finished:
            if seq.embedding:  # delivered here: its KV (and the row holding it) goes
                self.kv.release(seq)
        finished = embedding.finish_embeddings(finished, self.out, self.stats)
        self.kv.commit_prompts(finished, fused)
        for seq, _ in finished:
            seq.consumed = len(seq.prefill_ids)
            if not seq.preemptions:
                self.stats.on_prompt_done(seq.request, seq.cached_tokens if seq.index == 0 else None)
            self.kv.unpin(seq)
            done.append(seq)
