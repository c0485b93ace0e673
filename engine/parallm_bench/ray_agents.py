"""``parallm bench --workloads agents --ray-replicas N``: the agents trace (:mod:`parallm_bench.agents`) sent through
``parallm serve --ray``'s front (:mod:`parallm_engine.serve.ray_serve`) on a local Ray instance, three ways:

- ``one_replica``: one replica (the traffic one engine serves alone);
- ``replicas_prefix``: N replicas, routed by prefix / session / load (the default);
- ``replicas_round_robin``: N replicas, round robin (what a plain load balancer does).

Each turn is a streamed ``/v1/completions`` request with the conversation's token ids (greedy, EOS ignored); its
next prompt is the prompt + the reply's text encoded + the tool result (the API returns text, not ids). Each entry:
goodput and TTFT as in the agents workload, plus ``fleet_prefill_tokens`` (the replicas' own
``parallm_prefill_tokens_total``, from the front's aggregated ``/metrics``), ``affinity`` (the share of each
conversation's turns on the replica that served most of them, over all turns), ``later_turns_cached`` (the share
of turns >= 2 with ``cached_tokens > 0``) and the requests per replica. With ``kill_after`` (a share of the
trace's requests) one replica is killed once that many turns have finished: ``fault`` says how the run went
(requests lost, streams ended by the typed error and sent again by the agent, the replacement's arrival).

On one machine the replicas share its cores (and its memory bandwidth): 2 replicas on 2 cores do not double
its throughput; the prefill the routing saves is what carries over to a fleet of machines.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections import Counter

from parallm_bench.agents import AgentSizes, AgentTrace, _Recorder, build_trace

APP = "parallm-bench"
SYSTEMS = ("one_replica", "replicas_prefix", "replicas_round_robin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ray(num_cpus: int | None = None, port: int | None = None) -> str:
    """A local Ray instance and Serve's HTTP proxy on ``port``: the front's base URL."""
    import ray
    from ray import serve

    port = port or free_port()
    ray.init(num_cpus=num_cpus, include_dashboard=False, ignore_reinit_error=True,
             log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def deploy(replicas: int, routing: str = "prefix", model=None, **build_kwargs) -> None:
    """(Re)deploy the app: fresh replicas, empty prefix caches."""
    from ray import serve

    from parallm_engine.serve.ray_serve import build_app

    if APP in serve.status().applications:
        serve.delete(APP)
    serve.run(build_app(model, replicas=replicas, routing=routing, **build_kwargs), name=APP, route_prefix="/",
              blocking=False)


def kill_replica(replica: str) -> bool:
    """Kill the replica actor with this id (as a crash would: Ray's controller starts another)."""
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::") and actor["name"].endswith(f"#{replica}"):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            return True
    return False


def metric_by_replica(metrics_text: str, name: str) -> dict[str, float]:
    """One counter's value per ``replica`` label in the front's aggregated ``/metrics``."""
    out: dict[str, float] = {}
    for m in re.finditer(rf'^{name}{{replica="([^"]+)"[^}}]*}} ([0-9.e+-]+)$', metrics_text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


async def _stream_turn(client, base_url: str, prompt: list[int], reply_tokens: int) -> dict:
    """One streamed completion: its replica, first-token and token times, text, cached tokens, and the typed
    error event it ended with, if any."""
    body = {"prompt": prompt, "max_tokens": reply_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    out = {"times": [], "text": "", "cached": 0, "error": None, "replica": None, "status": None}
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
        out["status"], out["replica"] = resp.status_code, resp.headers.get("x-parallm-replica")
        if resp.status_code != 200:
            out["error"] = {"status": resp.status_code, "body": (await resp.aread()).decode()[:300]}
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
                continue
            text = "".join(c.get("text") or "" for c in chunk.get("choices", []))
            if text:
                out["times"].append(time.perf_counter())
                out["text"] += text
            if chunk.get("usage"):
                out["cached"] = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return out


def run_trace(base_url: str, trace: AgentTrace, encode, kill_after: float | None = None) -> dict:
    """The trace through the front. A turn whose stream ended with an error event is sent again (as an agent
    would), once per error; ``kill_after``: kill the replica that served the most turns once that share of the
    trace's requests has finished."""
    import httpx

    sz = trace.sizes
    rec = _Recorder(trace)
    placed: dict[int, list[str]] = {}  # agent -> the replica of each turn
    cached_by_turn: list[tuple[int, int]] = []  # (turn index, cached tokens)
    errors: list[dict] = []
    failed = [0]  # turns still failing after three tries (counted, never hidden)
    fault: dict = {}
    total = sum(trace.turns)
    finished = [0]

    async def maybe_kill():
        if kill_after is None or fault or finished[0] < kill_after * total:
            return
        victim = Counter(r for turns in placed.values() for r in turns).most_common(1)[0][0]
        fault.update({"killed": victim, "after_requests": finished[0], "at_s": time.perf_counter()})
        await asyncio.to_thread(kill_replica, victim)

    async def agent(client, a: int, t0: float):
        await asyncio.sleep(max(0.0, t0 + trace.arrivals[a] - time.perf_counter()))
        prompt = trace.system + trace.questions[a]
        for k in range(len(trace.tools[a]) + 1):
            for _attempt in range(3):
                ready = time.perf_counter()
                out = await _stream_turn(client, base_url, prompt, sz.reply_tokens)
                if out["error"] is None:
                    break
                errors.append({"agent": a, "turn": k, "replica": out["replica"], "error": out["error"]})
            else:
                failed[0] += 1
            ids = encode(out["text"])
            rec.turn(a, k, len(prompt), ready, out["times"], ids, out["cached"], len(out["times"]))
            placed.setdefault(a, []).append(out["replica"])
            cached_by_turn.append((k, out["cached"]))
            finished[0] += 1
            await maybe_kill()
            if k < len(trace.tools[a]):
                prompt = prompt + ids + trace.tools[a][k]
        rec.done[a] = time.perf_counter()

    async def main():
        n = len(trace.arrivals)
        limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            t0 = time.perf_counter()
            await asyncio.gather(*(agent(client, a, t0) for a in range(n)))
            return t0

    t0 = asyncio.run(main())
    summary = rec.summary(t0)
    summary.pop("ttfts_s", None)
    summary.pop("peak_mem_mb", None)  # replicas' memory is not this process's
    turns = [r for rs in placed.values() for r in rs]
    summary["requests_per_replica"] = dict(Counter(turns))
    summary["affinity"] = round(sum(Counter(rs).most_common(1)[0][1] for rs in placed.values()) / len(turns), 4)
    later = [c for k, c in cached_by_turn if k >= 1]
    summary["later_turns_cached"] = round(sum(c > 0 for c in later) / len(later), 4) if later else None
    summary["stream_errors"] = errors
    summary["failed_turns"] = failed[0]
    if fault:
        fault["at_s"] = round(fault["at_s"] - t0, 3)
        fault["completed_runs"] = len(rec.done)
        fault["requests_answered"] = finished[0]
        fault["requests_in_trace"] = total
        summary["fault"] = fault
    return summary


def fleet_prefill(base_url: str) -> dict[str, float]:
    import httpx

    return metric_by_replica(httpx.get(f"{base_url}/metrics", timeout=60).text, "parallm_prefill_tokens_total")


def wait_for_replicas(base_url: str, n: int, timeout_s: float = 180.0, exclude: str | None = None) -> list[str]:
    """Poll ``/replicas`` until ``n`` healthy replicas answer (none of them ``exclude``); their ids."""
    import httpx

    deadline = time.monotonic() + timeout_s
    ids: list[str] = []
    while time.monotonic() < deadline:
        try:
            got = httpx.get(f"{base_url}/replicas", timeout=30).json()["replicas"]
            ids = [r["replica"] for r in got if r["healthy"] and r["replica"] != exclude]
            if len(ids) >= n:
                return ids
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{n} replicas did not answer within {timeout_s:.0f} s (had {ids})")


def run_system(base_url: str, trace: AgentTrace, encode, replicas: int, routing: str,
               kill_after: float | None = None, **build_kwargs) -> dict:
    deploy(replicas, routing, **build_kwargs)
    wait_for_replicas(base_url, replicas)
    entry = run_trace(base_url, trace, encode, kill_after)
    if kill_after is not None and "fault" in entry:
        t = time.perf_counter()
        joined = wait_for_replicas(base_url, replicas, exclude=entry["fault"]["killed"])
        entry["fault"]["replacement_joined"] = sorted(set(joined) - set(entry["requests_per_replica"]))
        entry["fault"]["replacement_wait_after_run_s"] = round(time.perf_counter() - t, 2)
    prefill = fleet_prefill(base_url)
    entry["fleet_prefill_tokens"] = int(sum(prefill.values()))
    entry["prefill_tokens_per_replica"] = {k: int(v) for k, v in prefill.items()}
    entry.update({"replicas": replicas, "routing": routing})
    return entry


def run_ray_agents_workload(engine, sz: AgentSizes, replicas: int = 2, tick=None, num_cpus: int | None = None,
                            with_fault: bool = True) -> dict:
    """The three systems (and, ``with_fault``, the N-replica prefix run again with a replica killed a third
    of the way through) on one local Ray instance."""
    import os

    from ray import serve

    from parallm_engine.serve.ray_launch import require_ray

    require_ray()
    import ray

    tick = tick or (lambda msg: None)
    trace = build_trace(lambda s: engine.encode(s, add_special_tokens=False), sz)
    encode = lambda text: engine.encode(text, add_special_tokens=False)  # noqa: E731
    entry: dict = {"trace": trace.describe(), "cores": os.cpu_count()}
    entry["trace"].pop("arrivals_s", None)
    base_url = start_ray(num_cpus=num_cpus)
    try:
        for name, n, routing in (("one_replica", 1, "prefix"), ("replicas_prefix", replicas, "prefix"),
                                 ("replicas_round_robin", replicas, "round_robin")):
            tick(f"agents on Ray: {name}")
            entry[name] = run_system(base_url, trace, encode, n, routing)
        if with_fault:
            tick("agents on Ray: a replica killed")
            entry["replicas_prefix_killed"] = run_system(base_url, trace, encode, replicas, "prefix", kill_after=1 / 3)
    finally:
        serve.shutdown()
        ray.shutdown()
    one = entry["one_replica"]["fleet_prefill_tokens"]
    entry["ratios"] = {f"prefill_vs_one_{k}": round(entry[k]["fleet_prefill_tokens"] / one, 3) if one else None
                       for k in ("replicas_prefix", "replicas_round_robin")}
    entry["ratios"]["goodput_prefix_vs_round_robin"] = round(
        entry["replicas_prefix"]["goodput_runs_per_min"] / entry["replicas_round_robin"]["goodput_runs_per_min"], 2) \
        if entry["replicas_round_robin"]["goodput_runs_per_min"] else None
    return entry


def format_lines(entry: dict) -> list[str]:
    t = entry["trace"]
    lines = [f"agents on Ray Serve: {t['agents']} agents x {t['min_turns']}-{t['max_turns']} turns "
             f"({t['requests']} requests), {t['system_prompt_tokens']}-token shared system prompt, "
             f"{t['reply_tokens']}-token replies, arrivals {t['rate']}/s; one machine, {entry.get('cores')} cores "
             "shared by every replica"]
    for system in (*SYSTEMS, "replicas_prefix_killed"):
        s = entry.get(system)
        if not s:
            continue
        lines.append(f"  {system:22s}: goodput {s['goodput_runs_per_min']:6.1f} runs/min  TTFT p50 "
                     f"{s['ttft_p50_s']:.3f} p99 {s['ttft_p99_s']:.3f} s  fleet prefill {s['fleet_prefill_tokens']} "
                     f"tokens  affinity {s['affinity']:.0%}  turns>=2 cached {s['later_turns_cached']:.0%}  "
                     f"per replica {s['requests_per_replica']}")
        if s.get("fault"):
            f = s["fault"]
            lines.append(f"    killed {f['killed']} after {f['after_requests']} of {f['requests_in_trace']} requests: "
                         f"{f['requests_answered']} answered, {len(s['stream_errors'])} streams ended by the typed "
                         f"error (sent again), {f['completed_runs']} runs completed, replacement "
                         f"{f.get('replacement_joined')}")
    return lines
