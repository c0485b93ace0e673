"""Sessions (``kv/session_pins.py``, off by default: ``Engine(session_ttl=30)``): a request that names its session
keeps its context pinned in the prefix cache for the engine's ``session_ttl`` after its turn, so the next turn
finds it however busy the engine is. With the default (0) nothing is pinned.

- Under a prefix cache too small for the traffic between two turns, the second turn of a session finds its
  first turn's context cached (the same logprobs as a cold run); without a session it is evicted.
- The TTL lets go; ``release_session`` lets go; pins are bounded by their share of the KV budget, and give
  way when a waiting request needs the room (sessions never starve admission).
- The server reads the session from OpenAI's ``user``, the ``x-session-id`` header and Anthropic's
  ``metadata.user_id``; ``ChatParaLLM`` from ``session=`` or the LangGraph ``thread_id``.
- Bad values are typed errors.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
from parallm_engine import Engine
from parallm_engine.errors import InvalidRequestError

from .conftest import settled_stats, write_tiny_llama
from .model_zoo import prompt_ids

TURN = 200  # tokens of a first turn's context


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("session-llama"), max_position_embeddings=2048)


def _engine(model_dir, **kw) -> Engine:
    # A prefix cache that holds about one turn: the other traffic evicts anything not pinned.
    return Engine(str(model_dir), decode_lanes=1, prefix_cache_bytes=TURN * 700, kv_disk=0,
                  **{"session_ttl": 30.0, **kw})


def _turns(eng: Engine, session: str | None, vocab: int):
    """Turn 1, other traffic that fills the prefix cache, then turn 2 (turn 1's context, its answer and a
    tool result). Returns turn 2's result."""
    first = prompt_ids(TURN, vocab, seed=1)
    one = eng.generate([first], max_tokens=12, temperature=0, ignore_eos=True, session=session)[0]
    eng.generate([prompt_ids(TURN, vocab, seed=10 + i) for i in range(3)], max_tokens=4, temperature=0,
                 ignore_eos=True)
    second = first + one.token_ids + prompt_ids(20, vocab, seed=2)
    return second, eng.generate([second], max_tokens=6, temperature=0, ignore_eos=True, logprobs=True,
                                session=session)[0]


def test_a_session_keeps_its_context_between_turns(model_dir):
    vocab = 49152
    eng = _engine(model_dir)
    try:
        second, pinned = _turns(eng, "agent-1", vocab)
        stats = settled_stats(eng)["memory"]
        assert stats["sessions_pinned"] == 1 and stats["sessions_kept"] == 2
        from parallm_engine.serve.metrics import render_engine_stats

        page = "\n".join(render_engine_stats(settled_stats(eng), "m"))
        assert 'parallm_sessions_pinned{model="m"} 1' in page
    finally:
        eng.shutdown()
    eng = _engine(model_dir)
    try:
        _, unpinned = _turns(eng, None, vocab)
    finally:
        eng.shutdown()
    assert pinned.usage.cached_tokens == TURN + 11  # turn 1's context and its answer, bar the last token
    assert unpinned.usage.cached_tokens < TURN // 2  # evicted by the traffic between the turns
    fresh = Engine(str(model_dir), decode_lanes=1, kv_disk=0)
    try:
        cold = fresh.generate([second], max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)[0]
    finally:
        fresh.shutdown()
    assert pinned.token_ids == cold.token_ids
    assert [t.logprob for t in pinned.logprobs] == [t.logprob for t in cold.logprobs]


def test_the_ttl_and_release_let_go(model_dir):
    vocab = 49152
    ttl = 3.0  # (long enough for two short turns on a loaded machine)
    eng = _engine(model_dir, session_ttl=ttl)
    try:
        eng.generate([prompt_ids(TURN, vocab, seed=3)], max_tokens=4, temperature=0, session="a")
        eng.generate([prompt_ids(TURN, vocab, seed=4)], max_tokens=4, temperature=0, session="b")
        kept_b = time.monotonic()
        assert settled_stats(eng)["memory"]["sessions_pinned"] == 2
        assert eng.release_session("a") == 1 and eng.release_session("a") == 0
        time.sleep(max(0.0, kept_b + ttl + 0.1 - time.monotonic()))
        eng.generate([[300, 301]], max_tokens=1, temperature=0)  # a step: expired pins let go
        stats = settled_stats(eng)["memory"]
        assert stats["sessions_pinned"] == 0 and stats["sessions_expired"] == 1
        assert stats["prefix_cache_pinned_bytes"] == 0
    finally:
        eng.shutdown()


def test_pins_are_bounded_by_their_share_of_the_budget(model_dir):
    vocab = 49152
    eng = _engine(model_dir)
    try:
        kv = eng._scheduler.kv
        eng.config.session_share = 2.5 * TURN * kv.kv_bytes_per_token / eng.config.kv_budget_bytes  # two turns' pins
        kv.sessions.max_bytes = kv._session_bytes()
        prompts = [prompt_ids(TURN, vocab, seed=20 + i) for i in range(4)]
        for i, ids in enumerate(prompts):
            eng.generate([ids], max_tokens=2, temperature=0, session=f"s{i}")
        stats = settled_stats(eng)["memory"]
        assert stats["sessions_displaced"] == 2
        assert stats["sessions_pinned_bytes"] <= kv.sessions.max_bytes
        # A pin, once kept, lasts until its next turn: the turns that end when the pins are full keep what fits
        # of their context, the last none (the agent that has waited longest is the likeliest to come back next).
        assert set(kv.sessions.pins) == {"s0", "s1", "s2"}
        held = eng.run_on_engine_thread(lambda: [kv.radix.pinned_prefix(ids) for ids in prompts])
        assert held[:2] == [TURN, TURN] and 0 < held[2] <= TURN // 2 and held[3] == 0
    finally:
        eng.shutdown()


def test_bad_session_values_are_typed_errors(model_dir):
    eng = Engine(str(model_dir), kv_disk=0)
    try:
        for bad in (123, "", "x" * 257):
            with pytest.raises(InvalidRequestError) as err:
                eng.submit([300, 301], max_tokens=1, session=bad)
            assert err.value.param == "session"
    finally:
        eng.shutdown()
    for bad in (-1, "long", True):
        with pytest.raises(InvalidRequestError) as err:
            Engine(str(model_dir), session_ttl=bad)
        assert err.value.param == "session_ttl"


def test_the_server_reads_the_session_from_every_api(model_dir):
    from parallm_engine.serve.server import ServerThread

    eng = Engine(str(model_dir), kv_disk=0, session_ttl=30.0)
    try:
        with ServerThread(engine=eng, api_key="k") as srv:
            headers = {"Authorization": "Bearer k"}
            chat = {"model": model_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            r = httpx.post(f"{srv.url}/v1/chat/completions", json={**chat, "user": "openai-user"},
                           headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat,
                           headers={**headers, "x-session-id": "header-session"}, timeout=60)
            assert r.status_code == 200, r.text
            r = httpx.post(f"{srv.url}/v1/messages", json={**chat, "metadata": {"user_id": "anthropic-user"}},
                           headers={"x-api-key": "k", "anthropic-version": "2023-06-01"}, timeout=60)
            assert r.status_code == 200, r.text
            r = httpx.post(f"{srv.url}/v1/responses", json={"model": model_dir.name, "input": "hi", "max_output_tokens": 16,
                                                            "user": "responses-user"}, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            pins = eng.run_on_engine_thread(lambda: set(eng._scheduler.kv.sessions.pins))
    finally:
        eng.shutdown()
    assert pins == {"openai-user", "header-session", "anthropic-user", "responses-user"}


def test_chat_parallm_takes_the_langgraph_thread_and_session(model_dir):
    from langchain_core.messages import HumanMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    from parallm_engine import get_engine
    from parallm_integrations import ChatParaLLM

    opts = {"kv_disk": 0, "session_ttl": 30.0}
    eng = get_engine(str(model_dir), **opts)  # the engine the class below shares
    try:
        llm = ChatParaLLM(model=str(model_dir), engine_kwargs=opts, max_tokens=2, temperature=0)

        def node(state: MessagesState):
            return {"messages": [llm.invoke(state["messages"])]}

        graph = StateGraph(MessagesState)
        graph.add_node("model", node)
        graph.add_edge(START, "model")
        graph.add_edge("model", END)
        app = graph.compile()
        app.invoke({"messages": [HumanMessage("hi")]}, {"configurable": {"thread_id": "thread-7"}})
        ChatParaLLM(model=str(model_dir), engine_kwargs=opts, max_tokens=2, temperature=0,
                    session="named").invoke("hello")
        llm.invoke("hello", session="per-call")
        llm.invoke("hello")  # no thread, no session: nothing pinned
        pins = eng.run_on_engine_thread(lambda: set(eng._scheduler.kv.sessions.pins))
    finally:
        eng.shutdown()
    assert pins == {"thread-7", "named", "per-call"}


def test_kept_sessions_give_way_to_a_request_that_needs_the_room(model_dir):
    """A budget the kept sessions fill: a new request runs (a pin lets go for it), it is not left waiting."""
    vocab = 49152
    eng = Engine(str(model_dir), decode_lanes=1, kv_disk=0, kv_budget_bytes=64 << 20, session_ttl=30.0)
    try:
        kv = eng._scheduler.kv
        per_token = kv.kv_bytes_per_token
        eng.config.watermark_tokens = 16
        # Make the budget small enough that two kept turns leave no room for a third request.
        eng.config.kv_budget_bytes = int(2.6 * TURN * per_token)
        eng.config.radix_budget_bytes = eng.config.kv_budget_bytes
        eng.config.session_share = 1.0
        for i in range(2):
            eng.generate([prompt_ids(TURN, vocab, seed=40 + i)], max_tokens=2, temperature=0, session=f"k{i}")
        assert settled_stats(eng)["memory"]["sessions_pinned"] == 2
        out = eng.generate([prompt_ids(TURN, vocab, seed=50)], max_tokens=2, temperature=0, ignore_eos=True)[0]
        stats = settled_stats(eng)["memory"]
        held = eng.run_on_engine_thread(
            lambda: [kv.radix.pinned_prefix(prompt_ids(TURN, vocab, seed=40 + i)) for i in range(2)])
    finally:
        eng.shutdown()
    assert len(out.token_ids) == 2
    # The pin kept last gave up the end of its context, about what the request lacked; the first kept all of it.
    assert stats["sessions_displaced"] >= 1
    assert held[0] == TURN and held[1] < TURN


def test_sessions_are_on_by_default_and_session_ttl_0_turns_them_off(model_dir):
    from parallm_engine.kv.session_pins import DEFAULT_TTL_S

    for ttl, pinned in ((None, 1), (0, 0)):
        eng = Engine(str(model_dir), kv_disk=0, **({} if ttl is None else {"session_ttl": ttl}))
        try:
            assert eng.config.session_ttl_s == (DEFAULT_TTL_S if ttl is None else 0.0) and DEFAULT_TTL_S == 30.0
            eng.generate([prompt_ids(TURN, 49152, seed=60)], max_tokens=2, temperature=0, session="s")
            assert settled_stats(eng)["memory"]["sessions_pinned"] == pinned
        finally:
            eng.shutdown()


def _tree_with(contexts: dict[str, list[int]]):
    """A radix tree holding these contexts (KV: one float per token), and pins over it with no TTL running out."""
    from parallm_engine.kv.radix_cache import RadixCache
    from parallm_engine.kv.session_pins import SessionPins

    from .test_radix_cache import kv_for_tokens

    tree = RadixCache(max_bytes=1 << 30)
    for ids in contexts.values():
        tree.insert(ids, kv_for_tokens(ids))
    return tree, SessionPins(tree, ttl_s=60.0, max_bytes=0, bytes_per_token=1)


def test_the_pin_kept_last_gives_way_first():
    """A tool call takes a bounded time: the agent that has waited longest comes back next, so the pins kept
    last give way first (to the share's bound, to rows that need the room) and an earlier pin lasts. A pin
    that gives way falls back to the prefix its context shares with the others (the system prompt), which
    lets go only after every full pin has given way."""
    system = list(range(1000, 1010))
    ctx = {s: system + [i] * 20 for i, s in enumerate(["a", "b", "c"])}
    tree, pins = _tree_with(ctx)
    pins.max_bytes = 10 + 2 * 20  # the shared system prompt once and two agents' own tokens
    for s in ("a", "b", "c"):
        pins.keep(s, ctx[s], None)
    assert set(pins.pins) == {"a", "b", "c"} and pins.displaced == 1 and pins.nbytes == 50
    assert pins.pins["c"].shared_only and tree.pinned_prefix(ctx["c"]) == 10  # "c" keeps the system prompt
    assert tree.pinned_bytes() == tree.computed_pinned_bytes()
    assert pins.give_way(keep=None) and pins.pins["b"].shared_only and not pins.pins["a"].shared_only
    assert tree.pinned_prefix(ctx["b"]) == 10 and tree.pinned_prefix(ctx["a"]) == 30
    # The one a waiting request continues stays; the others pin only what it pins too: nothing to free.
    assert not pins.give_way(keep="a") and set(pins.pins) == {"a", "b", "c"}
    assert pins.give_way(keep=None) and pins.pins["a"].shared_only  # the last full pin falls back
    assert pins.give_way(keep=None) and not pins.pins  # and the shared prefix goes, for every pin over it at once
    assert tree.pinned_bytes() == 0 == tree.computed_pinned_bytes()


def test_an_overdue_pin_gives_way_first():
    """The gaps between a session's turn and its next one are measured (when the next turn is queued); a pin
    older than 1.5x the longest gap seen whose agent has not come back (it most likely finished: its last pin
    would hold its share for the whole TTL) gives way before the pins kept last, the most overdue first. Too
    few gaps seen, or its turn came back: the order is as before."""
    from parallm_engine.kv.session_pins import OVERDUE_FACTOR

    system = list(range(1000, 1010))
    ctx = {s: system + [i] * 20 for i, s in enumerate(["a", "b", "c", "d"])}
    tree, pins = _tree_with(ctx)
    pins.max_bytes = 1000
    for s in ("a", "b", "c", "d"):
        pins.keep(s, ctx[s], None)
    now = pins.pins["d"].kept_at
    assert pins.overdue_after() is None and pins._order(now=now + 100)[0] == "d"  # no gap seen: kept last first
    for s in ("b", "c", "d"):  # their next turns arrive 2 s after they were kept
        pins.expire(now=pins.pins[s].kept_at + 2.0, waiting={s})
    assert list(pins.gaps) == [2.0, 2.0, 2.0] and pins.overdue_after() == OVERDUE_FACTOR * 2.0
    assert pins._order(now=now + 3.5)[0] == "a"  # oldest, not back: it gives way first once overdue ...
    assert pins._order(now=now + 2.9)[-1] == "a"  # ... but not before (kept first: it gives way last)
    pins.gaps.clear()  # (give_way reads the clock: make "a" overdue now)
    pins.gaps.extend([0.0] * 3)
    assert pins.give_way() and pins.pins["a"].shared_only  # (it falls back to the system prompt, as any pin)
    assert tree.pinned_prefix(ctx["a"]) == 10 and tree.pinned_prefix(ctx["d"]) == 30
    assert tree.pinned_bytes() == tree.computed_pinned_bytes()


def test_a_pin_over_pages_a_running_row_holds_does_not_give_way():
    """Letting go of a pin that frees nothing (a running row holds the same prefix) only exposes it to eviction
    once the row leaves: it stays, and the pin that does free memory gives way instead."""
    system = list(range(1000, 1010))
    ctx = {"a": system + [1] * 20, "b": system + [2] * 20}
    tree, pins = _tree_with(ctx)
    pins.max_bytes = 1000
    pins.keep("a", ctx["a"], None)
    pins.keep("b", ctx["b"], None)  # kept last: it would give way first
    row = tree.match(ctx["b"], record=False)
    tree.pin(row.node)  # a running turn of "b" borrows its context
    before = tree.pinned_bytes()
    per_token = before // 50  # (the system prompt and both agents' own tokens)
    assert pins.give_way() and pins.pins["a"].shared_only and not pins.pins["b"].shared_only
    assert tree.pinned_bytes() == before - 20 * per_token
    assert not pins.give_way()  # "b" frees nothing while the row runs; "a" pins what "b" pins
    tree.unpin(row.node)
    undo = pins.let_go_all()  # (the scheduler asks what letting go of every pin would free)
    assert tree.pinned_bytes() == 0 and not pins.pins
    undo()
    assert set(pins.pins) == {"a", "b"} and tree.pinned_bytes() == 30 * per_token == tree.computed_pinned_bytes()


def test_a_pin_gives_up_about_what_is_lacking_from_the_end_of_its_context():
    """Rows short of a few tokens' room cost the pin kept last the end of its context (a page more: pages are
    whole), not all of it: its agent's next turn recomputes only that end."""
    system = list(range(1000, 1010))
    ctx = {"a": system + list(range(100, 140)), "b": system + list(range(200, 240))}
    tree, pins = _tree_with(ctx)
    pins.max_bytes = 1000
    pins.keep("a", ctx["a"], None)
    pins.keep("b", ctx["b"], None)
    assert pins.give_way(nbytes=5)  # 5 tokens short: "b" (kept last) gives up 5 + a page of 8
    assert tree.pinned_prefix(ctx["b"]) == 50 - 13 and tree.pinned_prefix(ctx["a"]) == 50
    assert pins.give_way(nbytes=100)  # more than it has past the system prompt: down to that
    assert pins.pins["b"].shared_only and tree.pinned_prefix(ctx["b"]) == 10 and tree.pinned_prefix(ctx["a"]) == 50
    assert tree.pinned_bytes() == tree.computed_pinned_bytes()


def test_a_turn_that_does_not_fit_keeps_the_context_it_had():
    """The pins are full when an agent's turn ends: it keeps what fits of its context pinned, at least its
    previous context (its next turn recomputes only the rest), instead of losing all of it."""
    first = list(range(2000, 2030))
    longer = first + list(range(3000, 3020))
    other = list(range(4000, 4030))
    tree, pins = _tree_with({"a": longer, "b": other})
    pins.max_bytes = 65
    pins.keep("a", first, None)
    pins.keep("b", other, None)
    pins.keep("a", longer, None)  # 30 + 50 > 65: "a" keeps what fits, its first 35 tokens
    assert set(pins.pins) == {"a", "b"} and pins.displaced == 1
    assert tree.pinned_prefix(longer) == 35 and tree.pinned_prefix(other) == 30
    pins.release("b")
    pins.keep("a", longer, None)  # now it fits
    assert tree.pinned_prefix(longer) == 50 and pins.nbytes == 50
    assert tree.pinned_bytes() == tree.computed_pinned_bytes()


def test_a_queued_turn_keeps_its_pin_past_the_ttl():
    """On a busy engine the next turn may wait in the queue longer than the TTL: its session's pin stays until
    it is admitted (the turn the pin is for); the others expire."""
    ctx = {"a": list(range(10, 40)), "b": list(range(50, 80))}
    tree, pins = _tree_with(ctx)
    pins.max_bytes = 100
    for s, ids in ctx.items():
        pins.keep(s, ids, None)
    assert pins.expire(now=float("inf"), waiting={"a"}) == 1 and set(pins.pins) == {"a"}
    assert pins.expire(now=float("inf")) == 1 and not pins.pins
    assert tree.pinned_bytes() == 0


def test_the_bench_counts_as_re_prefilled_only_tokens_computed_before():
    """``new_prompt_tokens``: a prompt's tokens past the longest prefix an earlier request held (its prompt and
    its reply bar the last token, which is sampled and never computed); the rest of the prefill was computed
    before (re-prefilled)."""
    from parallm_bench.agents import new_prompt_tokens

    turns = [([1, 2, 3, 4], [5, 6]),  # all new
             ([1, 2, 3, 9], [7]),  # another agent on the same 3-token system prompt: 1 new
             ([1, 2, 3, 4, 5, 6, 8], [0]),  # the first agent's next turn: its reply's last token (6) and 8 are new
             ([1, 2, 3, 9, 8], [])]  # the second one's: its 1-token reply was never computed
    assert new_prompt_tokens(turns) == [4, 1, 2, 1]
    assert new_prompt_tokens([]) == []


def test_the_agents_bench_reports_re_prefilled_tokens(model_dir):
    """One agent, three turns: with the prefix cache every prefilled token is new (re-prefilled 0); without it
    every earlier turn's context is prefilled again, and the bench says how much."""
    from parallm_bench.agents import AgentSizes, build_trace, run_parallm_agents

    sz = AgentSizes(agents=1, min_turns=3, max_turns=3, system_tokens=80, tool_min=20, tool_max=30,
                    reply_tokens=12, rate=0.0)
    runs = {}
    for cache in (True, False):
        eng = Engine(str(model_dir), kv_disk=0, enable_prefix_cache=cache)
        try:
            trace = build_trace(lambda s: eng.encode(s, add_special_tokens=False), sz)
            runs[cache] = run_parallm_agents(eng, trace)
        finally:
            eng.shutdown()
    first = len(trace.system) + len(trace.questions[0])
    new = first + sum(len(t) + 1 for t in trace.tools[0])  # each tool result and the reply's last token
    for out in runs.values():
        assert out["requests"] == 3 and out["new_tokens"] == new
        assert out["reprefilled_tokens"] == out["prefill_tokens"] - new
    assert runs[True]["reprefilled_tokens"] == 0 and runs[True]["prefill_tokens"] == new
    assert runs[False]["prefill_tokens"] == runs[False]["prompt_tokens"]
    assert runs[False]["reprefilled_tokens"] == runs[False]["prompt_tokens"] - new > 0
    assert runs[True]["outputs_digest"] == runs[False]["outputs_digest"]


def test_a_kept_turn_that_fits_goes_ahead_of_one_that_does_not(model_dir):
    """A session's turn whose context its pin holds needs only its new tokens: when the request at the head of
    the queue does not fit, it is admitted ahead of it (else its pin holds memory for a turn stuck behind a
    larger one), at most ``MAX_PASSES`` times per waiting request; without sessions the queue stays FIFO."""
    from parallm_engine.core.request import Channel, Request
    from parallm_engine.core.scheduler import Scheduler, SchedulerConfig
    from parallm_engine.core.admission_order import MAX_PASSES
    from parallm_engine.core.stats import EngineStats
    from parallm_engine.sampling.sampling_params import SamplingParams

    vocab = 49152
    eng = Engine(str(model_dir), kv_disk=0)
    try:
        per_token = eng.model_info.kv_bytes_per_token()

        def scheduler(ttl):
            config = SchedulerConfig(max_batch_size=16, kv_budget_bytes=600 * per_token, radix_budget_bytes=600 * per_token,
                                     decode_lanes=1, cpu_kernels=eng.backend.cpu_kernels, step_time_target_s=0.0,
                                     session_ttl_s=ttl, session_share=0.5)
            return Scheduler(eng.model, eng.tokenizer, eng.model_info, config, EngineStats())

        def request(ids, max_tokens, session=None):
            req = Request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), Channel())
            req.session = session
            return req

        for ttl in (60.0, 0.0):
            sched = scheduler(ttl)
            first = prompt_ids(100, vocab, seed=70)
            turn = request(first, 4, "s")
            sched.add(turn)
            while sched.has_work():
                sched.step()
            second = first + turn.sequences[0].output_ids + prompt_ids(10, vocab, seed=71)
            sched.add(request(prompt_ids(250, vocab, seed=72), 200))  # a long row keeps running
            while not sched.running:
                sched.step()
            head = request(prompt_ids(330, vocab, seed=73), 2)  # does not fit beside it
            later = [request(second, 2, "s" if ttl else None) for _ in range(MAX_PASSES + 1)]
            for req in [head] + later:
                sched.add(req)
            admitted = [s.request for s in sched.schedule().admitted]
            if not ttl:  # FIFO: everything waits behind the head
                assert admitted == [] and head.sequences[0].passed == 0
                continue
            assert head not in admitted and admitted == later[:MAX_PASSES]  # ... then the queue waits for it
            assert head.sequences[0].passed == MAX_PASSES
    finally:
        eng.shutdown()


def test_a_kept_turn_goes_first_even_where_the_head_fits(model_dir):
    """Under memory pressure every turn that waits lets its pin be displaced and pays its context again: a
    session's turn whose own context its pin holds is admitted first (it computes only what is new) also where
    the head of the queue would fit; without sessions the queue is FIFO."""
    from parallm_engine.core.request import Channel, Request
    from parallm_engine.core.scheduler import Scheduler, SchedulerConfig
    from parallm_engine.core.stats import EngineStats
    from parallm_engine.sampling.sampling_params import SamplingParams

    vocab = 49152
    eng = Engine(str(model_dir), kv_disk=0)
    try:
        per_token = eng.model_info.kv_bytes_per_token()
        for ttl in (60.0, 0.0):
            config = SchedulerConfig(max_batch_size=16, kv_budget_bytes=2000 * per_token,
                                     radix_budget_bytes=2000 * per_token, decode_lanes=1,
                                     cpu_kernels=eng.backend.cpu_kernels, step_time_target_s=0.0, session_ttl_s=ttl)
            sched = Scheduler(eng.model, eng.tokenizer, eng.model_info, config, EngineStats())
            first = prompt_ids(100, vocab, seed=80)
            turn = Request(first, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), Channel())
            turn.session = "s"
            sched.add(turn)
            while sched.has_work():
                sched.step()
            head = Request(prompt_ids(50, vocab, seed=81), SamplingParams(max_tokens=2, temperature=0.0), Channel())
            later = Request(first + turn.sequences[0].output_ids + prompt_ids(10, vocab, seed=82),
                            SamplingParams(max_tokens=2, temperature=0.0), Channel())
            later.session = "s" if ttl else None
            sched.add(head)
            sched.add(later)
            admitted = [s.request for s in sched.schedule().admitted]
            assert admitted == ([later, head] if ttl else [head, later])
            assert head.sequences[0].passed == (1 if ttl else 0)
    finally:
        eng.shutdown()


def test_sessions_on_a_mixed_layout_family_serve_as_without(tmp_path):
    """A family whose KV is not paged under the radix tree (gemma3_text's sliding window: the snapshot KV
    manager) keeps no pins: a session named on it changes nothing, and admission (which asks whether a turn's
    context is kept) does not fail on it."""
    from .model_zoo import build, default_tokenizer

    tok_dir, vocab = default_tokenizer()
    path = build("gemma3_text", tmp_path / "g3", tok_dir, vocab, verify=False)
    outputs = {}
    for ttl in (30.0, 0.0):
        eng = Engine(str(path), max_batch_size=8, decode_lanes=1, kv_disk=0, session_ttl=ttl)
        try:
            assert eng._scheduler.layout == "mixed"
            got = []
            for extra in ([], [5, 6, 7]):  # two turns of three sessions, all queued at once
                handles = [eng.submit(prompt_ids(40, vocab, seed=i) + extra, max_tokens=3, temperature=0,
                                      session=f"s{i}") for i in range(3)]
                got.append([eng._collect(h).token_ids for h in handles])
            outputs[ttl] = got
        finally:
            eng.shutdown()
    assert outputs[30.0] == outputs[0.0] and all(len(ids) == 3 for turn in outputs[0.0] for ids in turn)
