"""``parallm serve --ray``: replicas on Ray Serve behind one front routing by prefix and session (issue 60).

The routing policy (``serve/ray_routing.py``) and the missing-extra error run everywhere; the rest runs a local
Ray instance (2 CPUs) with 2 replicas of the default model, and is skipped where ``ray[serve]`` is not installed
(the ``ray`` extra; the root ``test`` extra installs it).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from parallm_engine.serve.ray_routing import ForwardedRequest, RoutingTable, block_hashes, routing_fields

try:
    import ray  # noqa: F401
    from ray import serve  # noqa: F401

    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False

needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray[serve] is not installed (pip install 'parallm-engine[ray]')")


# ---------------------------------------------------------------------------------------------------------
# The policy, without Ray
# ---------------------------------------------------------------------------------------------------------


def _request(text: str = "", session: str | None = None, target: str | None = None) -> ForwardedRequest:
    body = json.dumps({"messages": [{"role": "user", "content": text}]}).encode() if text else b"{}"
    blocks, _, _ = routing_fields("/v1/chat/completions", {}, body)
    return ForwardedRequest("POST", "/v1/chat/completions", b"", [], body, blocks, session, target)


def test_a_conversations_next_turn_shares_its_blocks():
    system = {"role": "system", "content": "You are an agent with tools. " * 40}
    turn1 = [system, {"role": "user", "content": "task one " * 30}]
    turn2 = turn1 + [{"role": "assistant", "content": "calling a tool"}, {"role": "tool", "content": "result " * 50}]
    other = [system, {"role": "user", "content": "a different task " * 30}]
    b1, b2, b3 = block_hashes(turn1), block_hashes(turn2), block_hashes(other)
    assert len(b1) >= 5 and b2[:len(b1) - 1] == b1[:-1]  # all but the block the next turn's JSON continues
    shared = next(i for i, (x, y) in enumerate(zip(b1, b3)) if x != y)
    assert 2 <= shared < len(b1)  # the system prompt's blocks, not the task's


SYSTEM = "You are a helpful agent with tools. " * 25  # ~3 blocks shared by every agent


def _agent(i: int, history: str = "") -> ForwardedRequest:
    return _request(SYSTEM + f"Agent {i}: find the report and summarise it. " * 30 + history)  # ~5 blocks its own


def test_prefix_holder_wins_within_the_slack_then_least_loaded():
    table = RoutingTable(slack=2)
    replicas = ["a", "b"]
    first = _agent(1)
    choice = table.choose(replicas, first)
    assert choice.reason == "least_loaded"
    table.routed(choice.ranks[0][0], first, choice.reason)
    holder = choice.ranks[0][0]
    other = "b" if holder == "a" else "a"
    # New agents share the system prompt with the holder: they go there while it carries at most `slack` (2)
    # requests more than the other replica ...
    for i in range(2):
        req = _agent(i + 2)
        choice = table.choose(replicas, req)
        assert (choice.ranks[0], choice.reason) == ([holder], "prefix")
        table.routed(holder, req, choice.reason)
    # ... and past it to the least loaded: the bounded imbalance (3 in flight vs 0).
    choice = table.choose(replicas, _agent(9))
    assert choice.reason == "overflow" and choice.ranks[0][0] == other
    # A conversation's next turn (the holder has most of its key) stays up to 4 x slack above the least loaded.
    for k in range(6):
        nxt = _agent(1, history=f" Tool result {k}: " + "rows " * 20)
        choice = table.choose(replicas, nxt)
        assert (choice.ranks[0], choice.reason) == ([holder], "prefix"), k
        table.routed(holder, nxt, choice.reason)
    assert table.in_flight[holder] == 9 and table.choose(replicas, _agent(1, " Tool result 9")).reason == "overflow"
    for _ in range(9):
        table.completed(holder)
    # Where a request was sent (the choice is recorded when made, before Ray sends it) is where its prompt is.
    spilled = _agent(1, " Tool result 9")
    assert table.records[other].matched(spilled.blocks) == len(spilled.blocks)
    assert (table.choose(replicas, _agent(9)).ranks[0], table.choose(replicas, _agent(9)).reason) == ([other], "prefix")
    # Nothing in common (and no session): least loaded, the smallest record first on ties.
    assert table.choose(replicas, _request("unrelated " * 60)).ranks[0][0] == other


def test_sessions_stick_and_a_lost_replica_lets_go():
    table = RoutingTable()
    req = _request("hello", session="alice")
    choice = table.choose(["a", "b"], req)
    table.routed(choice.ranks[0][0], req, choice.reason)
    pinned = choice.ranks[0][0]
    for text in ("something else entirely " * 20, "and more " * 30):
        assert table.choose(["a", "b"], _request(text, session="alice")).ranks[0] == [pinned]
    # The pinned replica died: the session goes where the load says and is pinned there.
    left = "b" if pinned == "a" else "a"
    choice = table.choose([left], _request("x", session="alice"))
    assert choice.ranks[0] == [left] and choice.reason == "least_loaded"
    assert table.choose([left], _request("y", target=pinned)).reason == "target_gone"  # a stored response's replica


def test_round_robin_alternates():
    table = RoutingTable(policy="round_robin")
    seen = [table.choose(["a", "b"], _request("same " * 80)).ranks[0][0] for _ in range(4)]
    assert seen in (["a", "b", "a", "b"], ["b", "a", "b", "a"])


def test_sessions_from_each_api():
    def session(path, headers, body):
        return routing_fields(path, headers, json.dumps(body).encode())[1]

    assert session("/v1/chat/completions", {}, {"user": "u1", "messages": []}) == "u1"
    assert session("/v1/messages", {}, {"metadata": {"user_id": "u2"}, "messages": []}) == "u2"
    assert session("/v1/responses", {"x-session-id": "s3"}, {"user": "u3", "input": "hi"}) == "s3"
    # Coding agents' ids, read by the server's own rule (request_identity.py): Codex CLI's, Claude Code's.
    assert session("/v1/responses", {"session-id": "s4"}, {"prompt_cache_key": "t4", "input": "hi"}) == "t4"
    assert session("/v1/messages", {}, {"metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "c5"})},
                                        "messages": []}) == "c5"
    assert routing_fields("/v1/responses", {}, b'{"previous_response_id": "resp-1", "input": "x"}')[2] == "resp-1"
    assert routing_fields("/v1/chat/completions", {}, b"not json") == ([], None, None)


# ---------------------------------------------------------------------------------------------------------
# Without Ray: a typed error naming the extra; nothing else imports Ray
# ---------------------------------------------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PARALLM_KV_DISK": "0"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_serve_ray_without_ray_is_a_typed_error_naming_the_extra():
    # Ray made unimportable in a child process (as where it is not installed).
    done = _python("import sys; sys.modules['ray'] = None\n"
                   "from parallm_engine.cli import main\n"
                   "from parallm_engine.serve.ray_launch import RayNotInstalledError, require_ray\n"
                   "try:\n    require_ray()\nexcept RayNotInstalledError as exc:\n    print('typed:', exc)\n"
                   "sys.exit(main(['serve', '--ray', '--replicas', '2', '--port', '1']))")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "typed: `parallm serve --ray` needs Ray Serve" in done.stdout
    assert "parallm-engine[ray]" in done.stderr and "error:" in done.stderr


def test_ray_options_without_ray_flag_are_refused():
    done = _python("import sys\nfrom parallm_engine.cli import main\n"
                   "sys.exit(main(['serve', '--replicas', '2', '--port', '1']))")
    assert done.returncode == 2 and "--replicas need --ray" in done.stderr


def test_the_server_and_the_cli_do_not_import_ray():
    done = _python("import sys\nimport parallm_engine.cli, parallm_engine.serve.server, parallm_engine.serve.ray_launch\n"
                   "import parallm_engine.serve.ray_routing\n"
                   "print('ray' in sys.modules)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------------------
# On a local Ray instance: 2 replicas of the default model
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def front():
    """Ray (2 CPUs, no dashboard), Serve's proxy on a free port, the app with 2 replicas: the front's URL."""
    if not HAVE_RAY:
        pytest.skip("ray[serve] is not installed (pip install 'parallm-engine[ray]')")
    import ray
    from ray import serve

    from parallm_bench import ray_agents as ra

    base_url = ra.start_ray(num_cpus=2)
    try:
        ra.deploy(2, "prefix")
        ra.wait_for_replicas(base_url, 2)
        yield base_url
    finally:
        serve.shutdown()
        ray.shutdown()


def _replicas(base_url: str) -> list[str]:
    import httpx

    return [r["replica"] for r in httpx.get(f"{base_url}/replicas", timeout=30).json()["replicas"] if r["healthy"]]


@needs_ray
def test_agents_turns_stay_on_one_replica_and_hit_its_cache(front, engine):
    from parallm_bench import ray_agents as ra
    from parallm_bench.agents import AgentSizes, build_trace

    sz = AgentSizes(agents=8, min_turns=3, max_turns=3, system_tokens=600, tool_min=40, tool_max=80, reply_tokens=8,
                    rate=1000.0)  # all 8 agents at once
    encode = lambda s: engine.encode(s, add_special_tokens=False)  # noqa: E731
    out = ra.run_trace(front, build_trace(encode, sz), encode)
    assert out["completed_runs"] == 8 and out["requests"] == 24 and not out["stream_errors"] and not out["failed_turns"]
    assert None not in out["requests_per_replica"]  # every answer said which replica served it
    assert out["affinity"] >= 0.9, out
    assert out["later_turns_cached"] == 1.0, out  # every turn >= 2 reused its conversation's KV
    assert len(out["requests_per_replica"]) == 2, out  # both replicas served (new agents spill past the slack)


@needs_ray
def test_metrics_aggregate_the_replicas_with_a_label(front):
    import httpx

    ids = _replicas(front)
    text = httpx.get(f"{front}/metrics", timeout=60).text
    assert text.count("# TYPE parallm_prefill_tokens_total counter") == 1  # one family, every replica's samples
    for rid in ids:
        assert f'parallm_prefill_tokens_total{{replica="{rid}",' in text
        assert f'parallm_requests_in_flight{{replica="{rid}",' in text or f'replica="{rid}"' in text
    assert "parallm_front_replicas 2" in text
    assert "parallm_router_requests_total{" in text


@needs_ray
def test_sessions_stick_to_one_replica_on_every_api(front):
    import httpx

    with httpx.Client(timeout=120) as c:
        chat = [c.post(f"{front}/v1/chat/completions", json={
            "user": "alice", "max_tokens": 2, "messages": [{"role": "user", "content": f"question {i} " * (5 + 20 * i)}]})
            for i in range(4)]
        header = [c.post(f"{front}/v1/chat/completions", headers={"x-session-id": "bob"}, json={
            "max_tokens": 2, "messages": [{"role": "user", "content": f"other {i} " * (3 + 25 * i)}]}) for i in range(3)]
        anthropic = [c.post(f"{front}/v1/messages", json={
            "model": "default", "max_tokens": 2, "metadata": {"user_id": "carol"},
            "messages": [{"role": "user", "content": f"hello {i} " * (4 + 20 * i)}]}) for i in range(3)]
        responses = c.post(f"{front}/v1/responses", json={"input": "hi", "max_output_tokens": 2, "user": "alice"})
    for group in (chat, header, anthropic):
        assert all(r.status_code == 200 for r in group), [r.text[:200] for r in group]
        assert len({r.headers["x-parallm-replica"] for r in group}) == 1
    assert responses.status_code == 200
    assert responses.headers["x-parallm-replica"] == chat[0].headers["x-parallm-replica"]  # alice's replica


@needs_ray
def test_errors_keep_each_apis_shape_through_the_front(front):
    import httpx

    with httpx.Client(timeout=60) as c:
        bad = c.post(f"{front}/v1/chat/completions", content=b"{bad json")
        anthropic = c.post(f"{front}/v1/messages", json={"max_tokens": "many"})
        model = c.post(f"{front}/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert bad.headers["x-parallm-replica"]
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    assert model.status_code == 404 and model.json()["error"]["code"] == "model_not_found"


@needs_ray
def test_a_client_gone_mid_stream_aborts_its_engine_request(front):
    import httpx

    body = {"prompt": "A long story:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{front}/v1/completions", json=body) as resp:
            replica = resp.headers["x-parallm-replica"]
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
        # The client is gone: the front cancels the replica's generator, the app sees the disconnect and the
        # engine aborts the request (its tokens stop well before 400).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = c.get(f"{front}/metrics").text
            if f'parallm_requests_in_flight{{replica="{replica}",model="SmolLM2-135M-Instruct"}} 0' in text:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"the replica still runs the request:\n{text}")


@needs_ray
def test_build_app_refuses_bad_scaling():
    from parallm_engine.errors import InvalidRequestError
    from parallm_engine.serve.ray_serve import build_app

    for kwargs in ({"replicas": 0}, {"min_replicas": 3, "max_replicas": 2}, {"max_replicas": 2},
                   {"routing": "random"}):
        with pytest.raises(InvalidRequestError):
            build_app(**kwargs)


@needs_ray
def test_a_replica_killed_mid_run(front):
    """Streams running on the killed replica end with the typed error; requests that had not answered yet are
    sent again to the other replica (none lost); Ray's replacement joins; the front keeps answering."""
    import httpx

    from parallm_bench import ray_agents as ra

    before = set(_replicas(front))
    streamed: dict[int, dict] = {}

    async def stream(client, i: int, started: asyncio.Event):
        out = {"tokens": 0, "error": None, "done": False, "replica": None}
        streamed[i] = out
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True,
                "temperature": 0}
        async with client.stream("POST", f"{front}/v1/completions", json=body,
                                 headers={"x-session-id": "doomed"}) as resp:
            out["replica"] = resp.headers["x-parallm-replica"]
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out["error"] = chunk["error"]
                    else:
                        out["tokens"] += 1
                        if out["tokens"] >= 2:
                            started.set()

    async def short(client, i: int):  # not streamed: nothing reaches the client before it ends
        body = {"prompt": f"Question {i}: what is {i} + {i}?", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        return await client.post(f"{front}/v1/completions", json=body, headers={"x-session-id": "doomed"})

    async def main():
        async with httpx.AsyncClient(timeout=httpx.Timeout(180.0)) as client:
            flags = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(stream(client, i, flags[i])) for i in range(3)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 120)
            victim = streamed[0]["replica"]
            # On the same replica (same session), running or queued but with nothing sent when it dies.
            shorts = [asyncio.create_task(short(client, i)) for i in range(6)]
            await asyncio.sleep(0.5)
            assert await asyncio.to_thread(ra.kill_replica, victim)
            t0 = time.monotonic()
            answers = await asyncio.wait_for(asyncio.gather(*shorts), 120)
            await asyncio.wait_for(asyncio.gather(*streams), 60)
            return victim, answers, time.monotonic() - t0

    victim, answers, took = asyncio.run(main())
    assert {s["replica"] for s in streamed.values()} == {victim}
    for s in streamed.values():  # ended by the typed error event, then [DONE], well before their 400 tokens
        assert s["error"] is not None and s["error"]["code"] == "replica_died", s
        assert s["done"] and s["tokens"] < 400
    assert all(r.status_code == 200 for r in answers), [r.text[:300] for r in answers]
    assert all(r.headers["x-parallm-replica"] != victim for r in answers)  # sent again, to a live replica
    assert took < 120
    joined = ra.wait_for_replicas(front, 2, timeout_s=180, exclude=victim)
    assert set(joined) - before, "Ray's replacement replica did not join"
    with httpx.Client(timeout=60) as c:
        again = c.post(f"{front}/v1/completions", json={"prompt": "after", "max_tokens": 2},
                       headers={"x-session-id": "doomed"})
    assert again.status_code == 200 and again.headers["x-parallm-replica"] != victim
    text = httpx.get(f"{front}/metrics", timeout=60).text
    assert "parallm_front_stream_errors_total 3" in text
    assert "parallm_front_retries_total 0" not in text


@needs_ray
def test_autoscaling_adds_a_replica_when_requests_queue(front):
    """--min-replicas 1 --max-replicas 2 with a target of 1 request in flight per replica: 4 long requests at
    once make Ray Serve start the second replica (its delays shortened for the test), and the front routes to it."""
    import httpx

    from parallm_bench import ray_agents as ra

    ra.deploy(1, min_replicas=1, max_replicas=2, target_ongoing_requests=1,
              autoscaling={"upscale_delay_s": 1.0, "metrics_interval_s": 0.5, "look_back_period_s": 2.0,
                           "downscale_delay_s": 600.0})
    ra.wait_for_replicas(front, 1)
    assert len(_replicas(front)) == 1

    def long(i: int):
        body = {"prompt": f"Story {i}:", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
        return httpx.post(f"{front}/v1/completions", json=body, timeout=300)

    with ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(long, i) for i in range(4)]
        grown = ra.wait_for_replicas(front, 2, timeout_s=150)
        assert len(grown) == 2
        assert all(a.result().status_code == 200 for a in answers)
    seen = {httpx.post(f"{front}/v1/completions", json={"prompt": f"q{i}", "max_tokens": 2}, timeout=60)
            .headers["x-parallm-replica"] for i in range(8)}
    assert seen <= set(grown)
