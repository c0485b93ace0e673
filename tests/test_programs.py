"""Programs: every call carries the agent run it belongs to; admission orders calls by program (a returning turn
whose context is held first, fair groups, then the program that started first) under a stated bound (no call
is passed by more than ``MAX_PASSES`` later ones); stats report each program; a thread's context stays cached
between its turns by default, and closing a run lets it go at once."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from parallm_engine.core.admission_order import MAX_PASSES, WINDOW, next_to_admit
from parallm_engine.core.programs import ProgramTable

from .conftest import settled_stats


# -- the order, as a property over arrival sequences ------------------------------------------------------------
class _Req:
    def __init__(self, i, priority, program, group):
        self.id, self.priority, self.program, self.group = i, priority, program, group
        self.arrival = float(i)


class _Seq:
    """What admission reads of a waiting sequence: its request and how often it was passed."""

    def __init__(self, req):
        self.request, self.passed = req, 0
        self.urgency = (req.priority, req.id)


class _Held:
    """The KV manager's two admission questions: whether a kept pin holds a sequence's own context, its bytes."""

    def __init__(self, held, sizes):
        self.held, self.sizes = held, sizes

    def holds_kept_context(self, seq):
        return seq.request.id in self.held

    def context_bytes(self, seq):
        return self.sizes[seq.request.id]


def _table(started: dict) -> ProgramTable:
    """A program table whose programs started at these times (seconds)."""
    from parallm_engine.core.programs import ProgramRecord

    programs = ProgramTable()
    for name, t in started.items():
        programs.records[name] = ProgramRecord(name, first_arrival=t, last_event=t, calls=1)
    return programs


_calls = st.lists(st.tuples(st.integers(0, 2), st.sampled_from([None, "a", "b", "c"]), st.integers(0, 3),
                            st.booleans(), st.integers(1, 100), st.integers(0, 3)), min_size=1, max_size=120)


@settings(max_examples=150, deadline=None)
@given(calls=_calls, started=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.floats(-100, 200)),
       room=st.integers(1, 150))
def test_admission_order_holds_priority_and_the_starvation_bound(calls, started, room):
    """Over any arrival sequence (calls arrive, then some are admitted, repeatedly): the admitted call always has
    the most urgent waiting priority, and no call is admitted after more than MAX_PASSES calls of its priority
    that arrived after it (its worst case is what the bound says)."""
    programs = _table(started)
    waiting, held, sizes, groups, order = [], set(), {}, {}, []
    for i, (priority, program, group, is_held, size, admit_after) in enumerate(calls):
        req = _Req(i, priority, program, group)
        seq = _Seq(req)
        sizes[i] = size
        if is_held:
            held.add(i)
        waiting.append(seq)
        waiting.sort(key=lambda s: s.urgency)
        for _ in range(admit_after):
            if not waiting:
                break
            chosen = next_to_admit(waiting, groups, room, _Held(held, sizes), programs)
            assert chosen.request.priority == waiting[0].request.priority
            waiting.remove(chosen)
            groups[chosen.request.group] = groups.get(chosen.request.group, 0) + 1
            order.append(chosen.request)
    worst = 0
    for pos, req in enumerate(order):
        later_first = sum(1 for r in order[:pos] if r.priority == req.priority and r.id > req.id)
        worst = max(worst, later_first)
    assert worst <= MAX_PASSES


def test_without_programs_admission_is_fifo_with_fair_groups():
    """Calls naming no program and no session: the queue is FIFO, except that a group with fewer sequences
    admitted goes first (one caller's large batch cannot lock out another's call)."""
    programs = ProgramTable()
    kv = _Held(set(), {i: 1 for i in range(10)})
    waiting = [_Seq(_Req(i, 0, None, "batch" if i < 8 else f"solo{i}")) for i in range(10)]
    groups, order = {}, []
    while waiting:
        chosen = next_to_admit(waiting, groups, 100, kv, programs)
        waiting.remove(chosen)
        groups[chosen.request.group] = groups.get(chosen.request.group, 0) + 1
        order.append(chosen.request.id)
    assert order == [0, 8, 9, 1, 2, 3, 4, 5, 6, 7]


def test_the_program_that_started_first_goes_first_and_a_held_turn_before_it():
    programs = _table({"old": -50.0, "new": 1.5})
    waiting = [_Seq(_Req(0, 0, "new", 0)), _Seq(_Req(1, 0, None, 1)), _Seq(_Req(2, 0, "old", 2))]
    assert next_to_admit(list(waiting), {}, 100, _Held(set(), {0: 1, 1: 1, 2: 1}), programs).request.id == 2
    assert waiting[0].passed == waiting[1].passed == 1
    # A call of no program started when it arrived: before a program that started later.
    assert next_to_admit(list(waiting[:2]), {}, 100, _Held(set(), {0: 1, 1: 1}), programs).request.id == 1
    # A returning turn whose own context a pin holds needs only its new tokens: it goes first where it fits.
    assert next_to_admit(list(waiting), {}, 100, _Held({0}, {0: 1, 1: 1, 2: 1}), programs).request.id == 0
    assert next_to_admit(list(waiting), {}, 100, _Held({0}, {0: 500, 1: 1, 2: 1}), programs).request.id == 2
    # A call passed MAX_PASSES times goes first, whenever its program started.
    waiting[1].passed = MAX_PASSES
    assert next_to_admit(list(waiting), {}, 100, _Held({0}, {0: 1, 1: 1, 2: 1}), programs).request.id == 1


def test_the_window_bounds_the_work_per_admission():
    programs = _table({"busy": 10.0, "early": -10.0})
    waiting = [_Seq(_Req(i, 0, "busy", i)) for i in range(WINDOW)] + [_Seq(_Req(WINDOW, 0, "early", "x"))]
    chosen = next_to_admit(waiting, {}, 100, _Held(set(), {i: 1 for i in range(WINDOW + 1)}), programs)
    assert chosen.request.id == 0  # the program that started first, beyond the window, is not looked at


# -- the real engine ------------------------------------------------------------------------------------------
def test_stats_report_each_program_and_a_running_programs_turn_goes_first(tiny_model_dir):
    """On one row: a program under way has its next turn admitted ahead of a new program's call that arrived
    before it (program-level first come); stats report each program's calls, tokens and times."""
    from parallm_engine import Engine

    eng = Engine(str(tiny_model_dir), max_batch_size=1, decode_lanes=1, kv_disk=0)
    try:
        rng = random.Random(5)
        prompt = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731
        eng.generate([prompt(200)], max_tokens=40, temperature=0, ignore_eos=True, program="agent")
        blocker = eng.submit(prompt(20), max_tokens=30, temperature=0, ignore_eos=True)  # holds the one row
        eng.run_on_engine_thread(lambda: None)
        newcomer = eng.submit(prompt(20), max_tokens=2, temperature=0, ignore_eos=True, program="newcomer")
        next_turn = eng.submit(prompt(20), max_tokens=2, temperature=0, ignore_eos=True, program="agent")
        for h in (blocker, newcomer, next_turn):
            list(h)
        assert next_turn.request.admitted_time < newcomer.request.admitted_time
        assert newcomer.request.sequences[0].passed == 1
        programs = settled_stats(eng)["programs"]
        assert set(programs) == {"agent", "newcomer"}
        agent, newcomer = programs["agent"], programs["newcomer"]
        assert agent["calls"] == agent["calls_finished"] == 2 and newcomer["calls"] == 1
        assert agent["prompt_tokens"] == 220 and agent["generated_tokens"] == 42
        assert agent["attained_service"] == 220 - agent["cached_tokens"] + 42
        assert agent["queued_s"] > 0 and agent["running_s"] > 0 and agent["in_flight"] == 0
        assert abs(agent["job_completion_s"] - (agent["queued_s"] + agent["running_s"] + agent["paused_s"])) < 1e-3
    finally:
        eng.shutdown()


def test_an_aborted_call_leaves_its_program_with_nothing_in_flight(tiny_model_dir):
    from parallm_engine import Engine

    eng = Engine(str(tiny_model_dir), max_batch_size=1, decode_lanes=1, kv_disk=0)
    try:
        running = eng.submit(list(range(100, 130)), max_tokens=50, temperature=0, ignore_eos=True, program="p")
        queued = eng.submit(list(range(200, 230)), max_tokens=5, temperature=0, program="p")
        queued.abort()
        list(running)
        p = settled_stats(eng)["programs"]["p"]
        assert p["calls"] == 2 and p["calls_aborted"] == 1 and p["calls_finished"] == 1 and p["in_flight"] == 0
    finally:
        eng.shutdown()


def test_bad_program_names_are_refused(tiny_engine):
    import pytest

    from parallm_engine.errors import InvalidRequestError

    for bad in ("", "x" * 257, 7):
        with pytest.raises(InvalidRequestError, match="program"):
            tiny_engine.submit([1, 2, 3], max_tokens=1, program=bad)


def _words(rng, n):
    vocab = ["river", "bridge", "market", "station", "library", "garden", "harbour", "tower", "square", "museum",
             "school", "orchard", "mill", "canal", "theatre", "chapel"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def test_a_threads_second_turn_finds_its_first_cached_under_other_traffic(tmp_path):
    """The issue's case, with the defaults and no disk tier: a ~600-token first turn of a thread, then 8 other
    ~600-token prompts through ``batch`` under a KV budget that cannot hold them all, then the thread's second
    turn: it finds its first turn cached (>= 90% of its prompt), from a bare ``invoke(..., config=)`` and from
    a LangGraph node alike; without a thread it does not (the pressure is real)."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    from parallm_engine import get_engine
    from parallm_integrations import ChatParaLLM

    from .conftest import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path / "llama-2k", max_position_embeddings=2048)
    per_token = get_engine(str(model_dir), kv_disk=0).model_info.kv_bytes_per_token()
    llm = ChatParaLLM(model=str(model_dir), temperature=0, max_tokens=8,
                      engine_kwargs={"kv_budget_bytes": 1400 * per_token, "kv_disk": 0, "decode_lanes": 1})
    rng = random.Random(11)

    def node(state: MessagesState):
        return {"messages": [llm.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", node)
    graph.add_edge(START, "model")
    graph.add_edge("model", END)
    app = graph.compile()

    def bare(messages, thread):
        return llm.invoke(messages, config={"configurable": {"thread_id": thread}} if thread else None)

    def in_graph(messages, thread):
        return app.invoke({"messages": messages}, config={"configurable": {"thread_id": thread}})["messages"][-1]

    found = {}
    for how, call, thread in (("bare", bare, "t-bare"), ("graph", in_graph, "t-graph"), ("none", bare, None)):
        first = [SystemMessage(_words(rng, 560)), HumanMessage("What changed in the town?")]
        answer = call(first, thread)
        llm.batch([[SystemMessage(_words(rng, 560)), HumanMessage("Summarise.")] for _ in range(8)])
        second = first + [AIMessage(answer.content), HumanMessage("And what stayed the same?")]
        reply = call(second, thread)
        usage = reply.usage_metadata
        found[how] = usage["input_token_details"].get("cache_read", 0) / usage["input_tokens"]
        llm._engine.release_session()  # the sessions' share of this budget holds one such context at a time
    assert found["bare"] >= 0.9 and found["graph"] >= 0.9, found
    assert found["none"] < 0.5, found
    programs = settled_stats(llm._engine)["programs"]
    assert programs["t-bare"]["calls"] == 2 and programs["t-graph"]["calls"] == 2


def test_close_lets_a_sessions_pin_go_at_once_in_process_and_over_http(tiny_model_dir):
    """``Engine.close_session`` and SGLang's ``POST /close_session`` free a run's pinned context now (not at its
    TTL) and drop its program's figures; bad bodies get 400, never a 5xx. A server request names its program
    with the ``program`` field or the ``x-parallm-program`` header."""
    import httpx
    import pytest

    from parallm_engine import Engine
    from parallm_engine.errors import InvalidRequestError
    from parallm_engine.serve.server import ServerThread

    eng = Engine(str(tiny_model_dir), decode_lanes=1, kv_disk=0)
    try:
        eng.generate([list(range(300, 340))], max_tokens=2, temperature=0, session="run-1")
        assert settled_stats(eng)["memory"]["sessions_pinned"] == 1
        assert eng.close_session("run-1") == {"released": 1, "program": True}
        stats = settled_stats(eng)
        assert stats["memory"]["sessions_pinned"] == 0 and "run-1" not in stats["programs"]
        with pytest.raises(InvalidRequestError, match="session"):
            eng.close_session("")
        with ServerThread(engine=eng) as srv:
            chat = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2, "user": "agent-9"}
            assert httpx.post(f"{srv.base_url}/chat/completions", json={**chat, "program": "job-1"}).status_code == 200
            assert httpx.post(f"{srv.base_url}/chat/completions", json=chat,
                              headers={"x-parallm-program": "job-2"}).status_code == 200
            programs = settled_stats(eng)["programs"]
            assert programs["job-1"]["calls"] == 1 and programs["job-2"]["calls"] == 1
            assert settled_stats(eng)["memory"]["sessions_pinned"] == 1  # agent-9's context
            r = httpx.post(f"{srv.url}/close_session", json={"session_id": "agent-9"})
            assert r.status_code == 200 and r.json() == {"released": 1, "program": False}
            assert settled_stats(eng)["memory"]["sessions_pinned"] == 0
            for bad in ({}, {"session_id": ""}, {"session_id": 5}, {"session_id": "x" * 300}):
                assert httpx.post(f"{srv.url}/close_session", json=bad).status_code == 400
            bad_program = httpx.post(f"{srv.base_url}/chat/completions", json={**chat, "program": ""})
            assert bad_program.status_code == 400
    finally:
        eng.shutdown()


def test_the_programs_bench_runs_every_system_on_one_trace(tiny_model_dir):
    """``parallm bench --workloads programs`` on a small trace: FIFO without retention and the defaults serve
    the same tokens (same outputs digest) with and without memory pressure; every program completes on every
    system (mlx-lm's BatchGenerator too); re-prefilled tokens are never negative; no call was passed more
    often than the bound; the summary prints."""
    from parallm_bench import programs as bpr
    from parallm_engine import Engine
    from parallm_engine.core.admission_order import MAX_PASSES

    sizes = bpr.ProgramSizes(coding=1, coding_turns=(3, 3), coding_result=(20, 40), bfcl=1, bfcl_turns=(2, 2),
                             bfcl_result=(10, 20), fanout=1, fanout_branches=3, system_tokens=60, reply_tokens=4,
                             pause_median_s=0.05, pause_range_s=(0.01, 0.1), rate=20.0, seed=3)
    eng = Engine(str(tiny_model_dir), decode_lanes=1, kv_disk=0)
    try:
        r = bpr.run_programs(eng, sizes)
    finally:
        eng.shutdown()
    assert r["trace"]["programs"] == {"coding": 1, "bfcl": 1, "fanout": 1} and r["trace"]["calls"] == 3 + 2 + 5
    for name in ("tight", "roomy"):
        row = r[name]
        assert row["same_outputs"], row
        for mode in ("fifo", "programs"):
            s = row[mode]
            assert s["completed"] == 3 and s["calls"] == 10 and s["reprefilled_tokens"] >= 0
            assert s["most_passed"] <= MAX_PASSES
        assert row["fifo"]["most_passed"] == 0  # FIFO passes nobody
    assert r["mlx_lm_batch"]["completed"] == 3 and r["mlx_lm_batch"]["calls"] == 10
    assert any(line.startswith("  tight: fifo / programs") for line in bpr.format_lines(r))


def test_chat_parallm_closes_a_thread_in_process_and_over_base_url(tiny_model_dir):
    """``ChatParaLLM.close_session`` lets a thread's pin go: on its own engine, and on a server's through
    ``base_url=`` (the server's ``POST /close_session``)."""
    from parallm_engine import Engine
    from parallm_engine.serve.server import ServerThread
    from parallm_integrations import ChatParaLLM

    eng = Engine(str(tiny_model_dir), decode_lanes=1, kv_disk=0)
    try:
        with ServerThread(engine=eng, api_key="k") as srv:
            remote = ChatParaLLM(base_url=srv.base_url, api_key="k", max_tokens=2, temperature=0)
            remote.invoke("Hello there", config={"configurable": {"thread_id": "t-remote"}})
            assert settled_stats(eng)["memory"]["sessions_pinned"] == 1
            assert remote.close_session("t-remote") == {"released": 1, "program": True}
            assert settled_stats(eng)["memory"]["sessions_pinned"] == 0
    finally:
        eng.shutdown()
    local = ChatParaLLM(model=str(tiny_model_dir), max_tokens=2, temperature=0, engine_kwargs={"kv_disk": 0})
    local.invoke("Hello there", config={"configurable": {"thread_id": "t-local"}})
    assert local.close_session("t-local")["released"] == 1


def test_metrics_report_programs_with_bounded_labels(tiny_model_dir):
    """/metrics carries the programs tracked and in flight, and per program (the 16 most recent) its times and
    tokens: label cardinality stays bounded however many programs run."""
    import httpx

    from parallm_engine import Engine
    from parallm_engine.serve.metrics import METRIC_PROGRAMS
    from parallm_engine.serve.server import ServerThread

    eng = Engine(str(tiny_model_dir), decode_lanes=1, kv_disk=0, session_ttl=0)
    try:
        for i in range(METRIC_PROGRAMS + 4):
            eng.generate([[500 + i, 501, 502]], max_tokens=1, temperature=0, program=f"run-{i}")
        settled_stats(eng)
        with ServerThread(engine=eng) as srv:
            body = httpx.get(f"{srv.url}/metrics").text
    finally:
        eng.shutdown()
    assert f"parallm_programs_tracked{{model=" in body and "parallm_programs_in_flight{" in body
    series = [line for line in body.splitlines() if line.startswith("parallm_program_calls{")]
    assert len(series) == METRIC_PROGRAMS
    assert 'program="run-19"' in series[-1] and not any('program="run-0"' in line for line in series)
