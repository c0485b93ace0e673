"""The live view's JSON (issue 76): ``GET /v1/status`` and its event stream on a real ``parallm serve`` app on
loopback, with a key; bad queries get 4xx; the in-process page (``serve_dashboard``) on the same engine."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from parallm_engine.serve.live_server import serve_dashboard, stop_dashboard
from parallm_engine.serve.server import ServerThread, create_app

KEY = "live-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = "You are the planner of a team of agents. Answer with one short sentence, no lists. " * 3


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(create_app(engine=engine, api_key=KEY)) as srv:
        yield srv


def _prompts(engine, n: int, tag: str) -> list:
    return [engine.apply_chat_template([{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": f"{tag} question {i}"}]) for i in range(n)]


def _wait_for(get, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = get()
        if check(value):
            return value
        assert time.monotonic() < deadline, f"timed out; last: {json.dumps(value)[:800]}"
        time.sleep(0.1)


def test_status_shows_a_fan_out_its_rows_and_the_shared_prefix(engine, server):
    engine.generate(_prompts(engine, 1, "warm"), max_tokens=2)  # the system prompt is in the tree first
    fan = threading.Thread(target=engine.generate, args=(_prompts(engine, 8, "fan"),),
                           kwargs={"max_tokens": 48, "temperature": 0.0, "ignore_eos": True})
    fan.start()
    try:
        status = lambda: httpx.get(f"{server.url}/v1/status", headers=AUTH, timeout=30).json()  # noqa: E731
        snap = _wait_for(status, lambda s: sum(r["phase"] == "decode" for r in s["requests"]) >= 4)
        eng = snap["engine"]
        for key in ("rows_running", "rows_waiting", "kv_bytes_held", "kv_budget_bytes", "prefix_cache_bytes",
                    "pinned_sessions", "disk_tier", "tokens_per_s", "queue_depth", "weight_bytes"):
            assert key in eng, key
        assert eng["rows_running"] >= 4 and eng["kv_bytes_held"] > 0 and eng["kv_budget_bytes"] > 0
        row = next(r for r in snap["requests"] if r["phase"] == "decode")
        assert set(row) >= {"id", "phase", "program", "cached_tokens", "generated_tokens", "tokens_per_s", "pinned",
                            "queue_position", "pages"}
        assert row["program"] is None and row["queue_position"] is None and row["pages"] > 0
        assert row["cached_tokens"] > 0  # the system prompt came from the cache
        # Tokens per second per row, once two snapshots saw it decode.
        snap = _wait_for(status, lambda s: any(r["tokens_per_s"] > 0 for r in s["requests"]))
        lanes = {r["lane"] for r in snap["timeline"] if r["finish_ago"] is None}
        assert lanes >= {r["id"] for r in snap["requests"]}
    finally:
        fan.join()
    snap = httpx.get(f"{server.url}/v1/status?sections=tree,timeline", headers=AUTH, timeout=30).json()
    assert set(snap) == {"time", "tree", "timeline"}
    shared = [n for n in snap["tree"]["nodes"] if "planner of a team" in n["text"]]
    assert shared and max(n["hits"] for n in shared) >= 8, snap["tree"]["nodes"][:3]
    done = [r for r in snap["timeline"] if r["output_tokens"] == 48]  # the fan-out's 8 calls, from the recorder
    assert len(done) == 8 and all(r["finish_reason"] == "length" and r["cached_tokens"] > 0 for r in done)
    assert all(r["arrival_ago"] >= r["admitted_ago"] >= r["first_token_ago"] >= r["finish_ago"] for r in done)


def test_an_aborted_request_ends_its_lane_as_aborted(engine, server):
    handle = engine.submit(_prompts(engine, 1, "abort")[0], max_tokens=400, ignore_eos=True, session="agent-7")
    stream = iter(handle)
    next(stream)  # decoding
    snap = httpx.get(f"{server.url}/v1/status", headers=AUTH, timeout=30).json()
    mine = next(r for r in snap["requests"] if r["id"] == handle.id)
    assert mine["program"] == "agent-7" and mine["phase"] == "decode"
    handle.abort()
    engine.run_on_engine_thread(lambda: None)  # the abort has reached the engine thread
    snap = httpx.get(f"{server.url}/v1/status?sections=timeline", headers=AUTH, timeout=30).json()
    rec = next(r for r in snap["timeline"] if r["id"] == handle.id)
    assert rec["lane"] == "agent-7" and rec["aborted"] and rec["finish_ago"] is not None


@pytest.mark.parametrize("query", ["sections=bogus", "sections=", "limit=abc", "limit=0", "limit=nan",
                                   "limit=1&limit=2", "verbose=1", "sections=engine,%ff"])
def test_bad_status_queries_get_400(server, query):
    r = httpx.get(f"{server.url}/v1/status?{query}", headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_the_live_routes_need_the_key_as_header_query_or_cookie(server):
    for path in ("/v1/status", "/v1/status/stream", "/dashboard", "/dashboard/dashboard.js"):
        assert httpx.get(server.url + path, timeout=30).status_code == 401, path
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/v1/status?key={KEY}&sections=engine", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/v1/status", headers={"x-api-key": KEY}, timeout=30).status_code == 200
    with httpx.Client(base_url=server.url, timeout=30) as browser:  # the page sets the cookie its stream sends
        page = browser.get(f"/dashboard?key={KEY}")
        assert page.status_code == 200 and "<title>ParaLLM live</title>" in page.text
        assert browser.get("/dashboard/uPlot.iife.min.js").status_code == 200
        assert browser.get("/v1/status?sections=engine").json()["engine"]["model"]
        for bad in ("/dashboard/nope.js", "/dashboard/..%2f..%2fserver.py", "/dashboard/index.html"):
            r = browser.get(bad)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", bad
        assert browser.get("/dashboard?bogus=1").status_code == 400
        assert browser.get("/v1/status?key=wrong").status_code == 401  # a key given is the one checked
        assert browser.get("/v1/status/stream?interval=0").status_code == 400
        assert browser.get("/v1/status/stream?interval=inf").status_code == 400
    with httpx.Client(base_url=server.url, timeout=30) as other:  # only a valid ?key= becomes the cookie
        assert other.get("/dashboard?key=wrong", headers=AUTH).status_code == 200 and not other.cookies


def test_the_stream_sends_snapshots(server):
    events = []
    with httpx.stream("GET", f"{server.url}/v1/status/stream?interval=0.2&sections=engine", headers=AUTH,
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    break
    assert all(set(e) == {"time", "engine"} for e in events) and events[1]["time"] > events[0]["time"]


def test_an_in_process_engine_serves_its_page_on_loopback(engine):
    url = serve_dashboard(engine)
    try:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/dashboard")
        assert serve_dashboard(engine) == url  # one page per engine
        assert "ParaLLM live" in httpx.get(url, timeout=30).text
        base = url.rsplit("/", 1)[0]
        assert httpx.get(f"{base}/v1/status?sections=engine", timeout=30).json()["engine"]["max_queue"] > 0
        assert httpx.get(f"{base}/v1/chat/completions", timeout=30).status_code == 404  # the page alone
    finally:
        assert stop_dashboard(engine)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=5)


def test_queue_positions_and_preemptions_under_a_tight_kv_budget(tiny_engine, tiny_model_dir):
    """64 requests on a KV budget far too small for them (a tiny random model): while they run, the queued rows
    are numbered 0, 1, 2... in queue order; afterwards the timeline marks the preempted calls, each mark between
    the call's admission and its end."""
    from parallm_engine import Engine
    from parallm_engine.core.live_status import live_status

    from .model_zoo import prompt_ids

    vocab = tiny_engine.model_info.vocab_size
    small = Engine(str(tiny_model_dir), kv_budget_bytes=tiny_engine.model_info.kv_bytes_per_token() * 400,
                   decode_lanes=1)
    try:
        view = live_status(small)
        handles = [small.submit(prompt_ids(8 + (i % 13), vocab, seed=i), max_tokens=24, ignore_eos=True,
                                session=f"agent-{i % 4}") for i in range(64)]
        queued = []
        while not all(h.request.finished for h in handles):
            snap = view.snapshot(max_age=0.0)
            positions = [r["queue_position"] for r in snap["requests"] if r["phase"] == "queued"]
            if positions:
                queued.append(positions)
            time.sleep(0.05)
        assert queued and all(p == list(range(len(p))) for p in queued), queued[:3]
        assert small.stats()["preemptions"] > 0
        snap = view.snapshot(max_age=0.0)
        assert {r["lane"] for r in snap["timeline"]} == {f"agent-{i}" for i in range(4)}
        preempted = [r for r in snap["timeline"] if r["preemptions"]]
        assert preempted and all(len(r["preempted_ago"]) == r["preemptions"] for r in preempted)
        assert all(r["admitted_ago"] >= t >= r["finish_ago"] for r in preempted for t in r["preempted_ago"])
    finally:
        small.shutdown()


def test_a_stopped_engine_ends_the_stream_and_answers_503(tiny_model_dir):
    from parallm_engine import Engine

    eng = Engine(str(tiny_model_dir), decode_lanes=1)
    url = serve_dashboard(eng, api_key=KEY)
    base = url.rsplit("/", 1)[0]
    try:
        with httpx.stream("GET", f"{base}/v1/status/stream?interval=0.2&sections=engine", headers=AUTH,
                          timeout=30) as r:
            lines = r.iter_lines()
            assert any(line.startswith("data: ") for line in lines)
            eng.shutdown()
            rest = list(lines)  # the server ends the stream after saying why
        assert "event: engine_dead" in rest
        r = httpx.get(f"{base}/v1/status", headers=AUTH, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert httpx.get(url, headers=AUTH, timeout=30).status_code == 200  # the page itself still loads
    finally:
        stop_dashboard(eng)
        eng.shutdown()
