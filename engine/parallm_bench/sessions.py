"""The ``sessions`` workload of `parallm bench`: agents whose tools take seconds, under memory pressure.

The agents trace (``bench_agents``) with a tool call of 2-10 s between turns (drawn per turn from the seed),
on engines of the same model whose KV budget is about a third of the trace's working set (the system
prompt once, plus every agent's longest conversation): while an agent waits for its tool the other agents'
prompts fill the prefix cache and, with plain LRU, evict its conversation. Two runs on fresh engines of that
budget: ``lru`` (no session named) and ``sessions`` (each agent's turns name its session, so its context
stays pinned between turns: ``kv/session_pins.py``); and the same two with the engine's default budget
(no pressure: sessions must change nothing). Reported per run: re-prefilled tokens (prompt tokens not
served from the cache), TTFT p50 / p99, goodput; and the ratios lru / sessions. The default budget's
re-prefill is what no cache can avoid (every turn's new tokens: its tool result, the reply's last token), so
``tight.best_prefill_ratio`` (lru on the tight budget / the default budget's) is the most any retention policy
could reach on this trace, and ``tight.avoidable_saved`` the share of the re-prefill eviction caused that
sessions saved.

JSON::

    {"trace": {...}, "kv_budget_bytes", "working_set_bytes",
     "tight": {"lru": {...}, "sessions": {...}, "prefill_ratio", "ttft_p50_ratio", "best_prefill_ratio",
               "avoidable_saved"},
     "roomy": {"lru": {...}, "sessions": {...}, "prefill_ratio", "ttft_p50_ratio"}}
"""

from __future__ import annotations

import random
from dataclasses import replace

from parallm_engine.kv.session_pins import DEFAULT_TTL_S

from parallm_bench.agents import FULL_AGENTS, QUICK_AGENTS, build_trace, run_parallm_agents

#: (agent sizes, tool delay range in seconds)
FULL_SESSIONS = (FULL_AGENTS, (2.0, 10.0))
QUICK_SESSIONS = (replace(QUICK_AGENTS, agents=8, min_turns=3, max_turns=4, rate=2.0), (1.0, 3.0))


def _run(engine_for, trace, sessions: bool, delays) -> dict:
    eng = engine_for()
    try:
        eng.generate([trace.system[:8]], max_tokens=2, temperature=0)  # warm-up
        out = run_parallm_agents(eng, trace, sessions=sessions, delay=lambda a, k: delays[a][k])
        out["sessions_kept"] = eng.stats()["memory"].get("sessions_kept", 0)
        return {k: v for k, v in out.items() if k != "ttfts_s"}
    finally:
        eng.shutdown()


def run_sessions(engine, sizes=FULL_SESSIONS, tick=None) -> dict:
    from parallm_engine.core.engine import Engine

    tick = tick or (lambda msg: None)
    agent_sizes, (lo, hi) = sizes
    trace = build_trace(lambda s: engine.encode(s, add_special_tokens=False), agent_sizes)
    rng = random.Random(agent_sizes.seed + 1)
    delays = [[rng.uniform(lo, hi) for _ in t] for t in trace.tools]
    per_token = engine._scheduler.kv.kv_bytes_per_token
    system = len(trace.system)
    longest = [system + len(q) + sum(map(len, t)) + (len(t) + 1) * agent_sizes.reply_tokens
               for q, t in zip(trace.questions, trace.tools)]
    working_set = (system + sum(n - system for n in longest)) * per_token
    budget = working_set // 3
    model, backend = engine.model_info.source, engine.backend.name
    out: dict = {"trace": trace.describe(), "working_set_bytes": working_set, "kv_budget_bytes": budget,
                 "tool_delay_s": [lo, hi]}
    for name, kw in (("tight", {"kv_budget_bytes": budget}), ("roomy", {})):
        row = {}
        for mode in ("lru", "sessions"):
            tick(f"sessions: {name} budget, {mode}")
            ttl = DEFAULT_TTL_S if mode == "sessions" else 0.0
            row[mode] = _run(lambda: Engine(model, backend=backend, kv_disk=0, session_ttl=ttl, **kw), trace,
                             mode == "sessions", delays)
        row["same_outputs"] = row["lru"]["outputs_digest"] == row["sessions"]["outputs_digest"]
        row["prefill_ratio"] = round(row["lru"]["prefill_tokens"] / max(1, row["sessions"]["prefill_tokens"]), 2)
        row["ttft_p50_ratio"] = round(row["lru"]["ttft_p50_s"] / max(row["sessions"]["ttft_p50_s"], 1e-6), 2)
        out[name] = row
    floor, tight = out["roomy"]["lru"]["prefill_tokens"], out["tight"]
    tight["best_prefill_ratio"] = round(tight["lru"]["prefill_tokens"] / max(1, floor), 2)
    avoidable = tight["lru"]["prefill_tokens"] - floor
    tight["avoidable_saved"] = round((tight["lru"]["prefill_tokens"] - tight["sessions"]["prefill_tokens"])
                                     / avoidable, 3) if avoidable > 0 else 0.0
    return out


def format_lines(r: dict) -> list[str]:
    t = r["trace"]
    lines = [f"sessions: {t['agents']} agents x {t['min_turns']}-{t['max_turns']} turns, tools "
             f"{r['tool_delay_s'][0]:g}-{r['tool_delay_s'][1]:g} s, KV budget {r['kv_budget_bytes'] / 2**20:.0f} MiB "
             f"(a third of the working set, {r['working_set_bytes'] / 2**20:.0f} MiB) and the default"]
    for name in ("tight", "roomy"):
        row = r[name]
        for mode in ("lru", "sessions"):
            s = row[mode]
            lines.append(f"  {name:5} {mode:8}: re-prefilled {s['prefill_tokens']:7d} of {s['prompt_tokens']} prompt "
                         f"tokens, TTFT p50 {s['ttft_p50_s']:.3f} p99 {s['ttft_p99_s']:.3f} s, goodput "
                         f"{s['goodput_runs_per_min']} runs/min")
        lines.append(f"  {name:5}: re-prefilled lru / sessions {row['prefill_ratio']}x, TTFT p50 "
                     f"{row['ttft_p50_ratio']}x; same outputs: {row['same_outputs']}")
    if "best_prefill_ratio" in r["tight"]:
        lines.append(f"  tight: at best (no eviction at all) lru / {r['tight']['best_prefill_ratio']}x; sessions saved "
                     f"{100 * r['tight']['avoidable_saved']:.0f}% of the re-prefill eviction caused")
    return lines
