"""Programs: every call carries the agent run it belongs to; admission orders calls by program (a returning turn
whose context is held first, least attained service next, fair groups, first come) under a stated bound (no
call is passed by more than ``MAX_PASSES`` later ones); stats report each program; a thread's context stays
cached between its turns by default."""

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


_calls = st.lists(st.tuples(st.integers(0, 2), st.sampled_from([None, "a", "b", "c"]), st.integers(0, 3),
                            st.booleans(), st.integers(1, 100), st.integers(0, 3)), min_size=1, max_size=120)


@settings(max_examples=150, deadline=None)
@given(calls=_calls, service=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 10_000)),
       room=st.integers(1, 150))
def test_admission_order_holds_priority_and_the_starvation_bound(calls, service, room):
    """Over any arrival sequence (calls arrive, then some are admitted, repeatedly): the admitted call always has
    the most urgent waiting priority, and no call is admitted after more than MAX_PASSES calls of its priority
    that arrived after it (its worst case is what the bound says)."""
    programs = ProgramTable()
    for name, tokens in service.items():
        programs.records[name] = type("R", (), {"service": tokens, "calls": 2})()
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


def test_the_program_served_least_goes_first_and_a_held_turn_before_it():
    programs = ProgramTable()
    programs.records["long"] = type("R", (), {"service": 5000, "calls": 9})()
    programs.records["short"] = type("R", (), {"service": 40, "calls": 2})()
    waiting = [_Seq(_Req(0, 0, "long", 0)), _Seq(_Req(1, 0, "short", 1)), _Seq(_Req(2, 0, "long", 2))]
    assert next_to_admit(list(waiting), {}, 100, _Held(set(), {0: 1, 1: 1, 2: 1}), programs).request.id == 1
    assert waiting[0].passed == 1
    # A returning turn whose own context a pin holds needs only its new tokens: it goes first where it fits.
    assert next_to_admit(list(waiting), {}, 100, _Held({2}, {0: 1, 1: 1, 2: 1}), programs).request.id == 2
    assert next_to_admit(list(waiting), {}, 100, _Held({2}, {0: 1, 1: 1, 2: 500}), programs).request.id == 1
    # A call passed MAX_PASSES times goes first, whatever its program has cost.
    waiting[0].passed = MAX_PASSES
    assert next_to_admit(list(waiting), {}, 100, _Held({2}, {0: 1, 1: 1, 2: 1}), programs).request.id == 0


def test_the_window_bounds_the_work_per_admission():
    programs = ProgramTable()
    programs.records["busy"] = type("R", (), {"service": 10, "calls": 2})()
    waiting = [_Seq(_Req(i, 0, "busy", i)) for i in range(WINDOW)] + [_Seq(_Req(WINDOW, 0, None, "x"))]
    chosen = next_to_admit(waiting, {}, 100, _Held(set(), {i: 1 for i in range(WINDOW + 1)}), programs)
    assert chosen.request.id == 0  # the idle program beyond the window is not looked at


# -- the real engine ------------------------------------------------------------------------------------------
def test_stats_report_each_program_and_admission_prefers_the_least_served(tiny_model_dir):
    """Two programs on one row: the one that has been served least is admitted first although its call arrived
    later; stats report each program's calls, tokens and times."""
    from parallm_engine import Engine

    eng = Engine(str(tiny_model_dir), max_batch_size=1, decode_lanes=1, kv_disk=0)
    try:
        rng = random.Random(5)
        prompt = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731
        eng.generate([prompt(200)], max_tokens=40, temperature=0, ignore_eos=True, program="long")
        blocker = eng.submit(prompt(20), max_tokens=30, temperature=0, ignore_eos=True)  # holds the one row
        eng.run_on_engine_thread(lambda: None)
        long_turn = eng.submit(prompt(20), max_tokens=2, temperature=0, ignore_eos=True, program="long")
        short_turn = eng.submit(prompt(20), max_tokens=2, temperature=0, program="short")
        for h in (blocker, long_turn, short_turn):
            list(h)
        assert short_turn.request.admitted_at < long_turn.request.admitted_at
        programs = settled_stats(eng)["programs"]
        assert set(programs) == {"long", "short"}
        long, short = programs["long"], programs["short"]
        assert long["calls"] == long["calls_finished"] == 2 and short["calls"] == 1
        assert long["prompt_tokens"] == 220 and long["generated_tokens"] == 42
        assert long["attained_service"] == 220 - long["cached_tokens"] + 42
        assert long["queued_s"] > 0 and long["running_s"] > 0 and long["in_flight"] == 0
        assert abs(long["job_completion_s"] - (long["queued_s"] + long["running_s"] + long["paused_s"])) < 1e-3
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
