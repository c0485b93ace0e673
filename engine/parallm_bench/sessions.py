"""The ``sessions`` workload of `parallm bench`: agents whose tools take seconds, under memory pressure.

The agents trace (``bench_agents``) with a tool call of 2-10 s between turns (drawn per turn from the seed),
on engines of the same model whose KV budget is about a third of the trace's working set (the system
prompt once, plus every agent's longest conversation): while an agent waits for its tool the other agents'
prompts fill the prefix cache and, with plain LRU, evict its conversation. Two runs on fresh engines of that
budget: ``lru`` (no session named) and ``sessions`` (each agent's turns name its session, so its context
stays pinned between turns: ``kv/session_pins.py``); and the same two with the engine's default budget
(no pressure: sessions must change nothing). Reported per run: ``prefill_tokens`` (prompt tokens not
served from the cache), ``new_tokens`` (prompt tokens no earlier request had computed: the system prompt's
first prefill, each turn's tool result and question, the last token of the reply before it:
``agents.new_prompt_tokens``; the same in every run of the trace), ``reprefilled_tokens`` (``prefill_tokens -
new_tokens``: computed again although the engine had computed them before: what retention can save), TTFT p50 /
p99, goodput, and what the engine saw (preemptions, prefix-cache evictions, pins kept / expired / displaced).
Per budget: ``reprefill_ratio`` (lru / sessions on re-prefilled tokens: the must-show figure; None where
sessions re-prefilled none), the raw
``prefill_ratio`` beside it, and ``ttft_p50_ratio``.

JSON::

    {"trace": {...}, "kv_budget_bytes", "working_set_bytes",
     "tight": {"lru": {...}, "sessions": {...}, "reprefill_ratio", "prefill_ratio", "ttft_p50_ratio",
               "same_outputs"},
     "roomy": {...the same}}
"""

from __future__ import annotations

import random
from dataclasses import replace

from parallm_engine.kv.session_pins import DEFAULT_TTL_S

from parallm_bench.agents import FULL_AGENTS, QUICK_AGENTS, build_trace, run_parallm_agents

#: (agent sizes, tool delay range in seconds)
FULL_SESSIONS = (FULL_AGENTS, (2.0, 10.0))
QUICK_SESSIONS = (replace(QUICK_AGENTS, agents=8, min_turns=3, max_turns=4, rate=2.0), (1.0, 3.0))


# What the engine saw in a run (``Engine.stats()``'s memory and prefix-cache figures): this run's counts.
_COUNTERS = ("preemptions", "evicted_tokens", "sessions_kept", "sessions_expired", "sessions_displaced")


def _engine_counts(eng) -> dict:
    eng.run_on_engine_thread(lambda: None)  # the stats of the step that retired the last turn
    s = eng.stats()
    both = {**s.get("prefix_cache", {}), **s["memory"]}
    return {k: both.get(k, 0) for k in _COUNTERS}


def _run(engine_for, trace, sessions: bool, delays) -> dict:
    eng = engine_for()
    try:
        eng.generate([trace.system[:8]], max_tokens=2, temperature=0)  # warm-up
        before = _engine_counts(eng)
        out = run_parallm_agents(eng, trace, sessions=sessions, delay=lambda a, k: delays[a][k])
        out["engine"] = {k: v - before[k] for k, v in _engine_counts(eng).items()}
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
        lru, kept = row["lru"]["reprefilled_tokens"], row["sessions"]["reprefilled_tokens"]
        row["reprefill_ratio"] = round(lru / kept, 2) if kept else None  # (None: sessions re-prefilled nothing)
        row["prefill_ratio"] = round(row["lru"]["prefill_tokens"] / max(1, row["sessions"]["prefill_tokens"]), 2)
        row["ttft_p50_ratio"] = round(row["lru"]["ttft_p50_s"] / max(row["sessions"]["ttft_p50_s"], 1e-6), 2)
        out[name] = row
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
            e = s.get("engine", {})
            lines.append(f"  {name:5} {mode:8}: re-prefilled {s['reprefilled_tokens']:7d} (prefilled "
                         f"{s['prefill_tokens']}, new {s['new_tokens']}, of {s['prompt_tokens']} prompt tokens), "
                         f"TTFT p50 {s['ttft_p50_s']:.3f} p99 {s['ttft_p99_s']:.3f} s, goodput "
                         f"{s['goodput_runs_per_min']} runs/min; preemptions {e.get('preemptions', 0)}, evicted "
                         f"{e.get('evicted_tokens', 0)} tokens, pins kept {e.get('sessions_kept', 0)} "
                         f"expired {e.get('sessions_expired', 0)} displaced {e.get('sessions_displaced', 0)}")
        ratio = f"{row['reprefill_ratio']}x" if row["reprefill_ratio"] is not None else \
            f"- ({row['lru']['reprefilled_tokens']} / 0)"
        lines.append(f"  {name:5}: re-prefilled lru / sessions {ratio} (prefilled "
                     f"{row['prefill_ratio']}x), TTFT p50 {row['ttft_p50_ratio']}x; same outputs: {row['same_outputs']}")
    return lines
