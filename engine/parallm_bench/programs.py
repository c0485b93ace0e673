"""The ``programs`` workload of `parallm bench`: agent runs (programs of many calls with tool pauses), not calls.

Three kinds of program, from the seed alone, over one shared system prompt (instructions and tool schemas),
arriving as a Poisson process:

- **coding**: a coding agent's run: ``coding_turns`` turns, each sending the whole conversation so far plus
  the last tool's output (``coding_result`` tokens: file contents, test logs), so its context grows turn by
  turn; its tools pause it for a log-normal time (median ``pause_median_s``, clipped to ``pause_range_s``).
- **bfcl**: a BFCL-like run: ``bfcl_turns`` turns, each reply making ``bfcl_calls`` parallel tool calls that
  run at once (the pause is the longest of them) and whose results come back together.
- **fanout**: a LangGraph ``Send`` fan-out: a planner call, then ``fanout_branches`` branch calls at once
  (each the planner's context plus its own instruction), then one reduce call over the branches' replies.

Replies are ``reply_tokens`` long, greedy, EOS ignored: every system does the same work. Systems, each on a
fresh engine of the same model:

- ``fifo``: the engine as before programs: call-level FIFO admission (no call names a program) and no
  retention (``session_ttl=0``).
- ``programs``: today's defaults: every call names its program, a run's main thread names it as its session
  (its context is kept between turns: ``kv/session_pins.py``), admission orders calls by program
  (``core/admission_order.py``).
- ``mlx_lm_batch``: mlx-lm's ``BatchGenerator`` + ``LRUPromptCache`` driven as ``mlx_lm.server`` drives them
  (as in the agents workload), on the same weights, once (it has no KV budget to set).

Under a KV budget of a third of the trace's working set (``tight``; the system prompt once, plus each
program's longest context) and the engine's default (``roomy``). The disk tier is off in every run, so no
token is read back from disk: re-prefilled tokens (``prefill - new``, exact from the trace as in the agents
workload) are all recomputed. Reported: job completion time (a program's arrival to its last token) mean /
p95 / per program, re-prefilled tokens, TTFT, the most times any call was passed by later ones (the
admission bound: at most ``admission_order.MAX_PASSES``), and the ratios fifo / programs.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import json
import math
import random
import time
from dataclasses import asdict, dataclass


from parallm_bench.agents import (_TASKS, _text_ids, new_prompt_tokens, server_insert, server_step,
                                   system_prompt_ids)
from parallm_bench.bench import _pct


@dataclass
class ProgramSizes:
    coding: int = 6
    coding_turns: tuple = (10, 30)
    coding_result: tuple = (100, 260)  # tokens of tool output per turn: contexts grow to ~4-8k
    bfcl: int = 8
    bfcl_turns: tuple = (2, 5)
    bfcl_calls: tuple = (1, 4)  # parallel tool calls per reply
    bfcl_result: tuple = (40, 160)  # tokens per tool result
    fanout: int = 2
    fanout_branches: int = 8
    system_tokens: int = 1500
    reply_tokens: int = 24
    pause_median_s: float = 3.0
    pause_sigma: float = 1.0
    pause_range_s: tuple = (0.5, 20.0)
    rate: float = 0.5  # programs per second (Poisson)
    seed: int = 2026


FULL_PROGRAMS = ProgramSizes()
QUICK_PROGRAMS = ProgramSizes(coding=3, coding_turns=(4, 6), coding_result=(60, 140), bfcl=4, bfcl_turns=(2, 3),
                              bfcl_result=(30, 80), fanout=1, system_tokens=400, reply_tokens=8,
                              pause_median_s=0.6, pause_range_s=(0.1, 2.0), rate=2.0)


@dataclass
class Program:
    kind: str
    arrival: float
    # steps[k]: the suffixes of step k's calls (each call's prompt: the program's context + its suffix); a
    # step of one call is the main thread (its prompt + reply become the context), a step of several is a
    # fan-out whose replies the next step's first call reads (``joins``)
    steps: list
    joins: list  # per step: the next step's first call starts with this step's replies
    pauses: list  # seconds after each step (its tools)


@dataclass
class ProgramTrace:
    system: list
    programs: list
    sizes: ProgramSizes

    def longest_context(self, p: Program) -> int:
        r = self.sizes.reply_tokens
        main = sum(len(s[0]) + r for s in p.steps if len(s) == 1)
        fan = max((len(c) + r for s in p.steps if len(s) > 1 for c in s), default=0)
        joined = sum(len(s) * r for s, j in zip(p.steps, p.joins) if j)
        return len(self.system) + main + fan + joined

    def describe(self) -> dict:
        kinds = {k: sum(p.kind == k for p in self.programs) for k in ("coding", "bfcl", "fanout")}
        return {**asdict(self.sizes), "programs": kinds, "system_prompt_tokens": len(self.system),
                "calls": sum(len(s) for p in self.programs for s in p.steps),
                "longest_context_tokens": max(self.longest_context(p) for p in self.programs),
                "arrivals_s": [round(p.arrival, 3) for p in self.programs]}


def _pause(rng: random.Random, sz: ProgramSizes) -> float:
    lo, hi = sz.pause_range_s
    return min(hi, max(lo, rng.lognormvariate(math.log(sz.pause_median_s), sz.pause_sigma)))


def build_trace(encode, sz: ProgramSizes) -> ProgramTrace:
    rng = random.Random(sz.seed)
    system = system_prompt_ids(encode, rng, sz.system_tokens)
    tool_open, tool_close = encode("<|im_end|>\n<|im_start|>tool\n"), encode("<|im_end|>\n<|im_start|>assistant\n")
    kinds = ["coding"] * sz.coding + ["bfcl"] * sz.bfcl + ["fanout"] * sz.fanout
    rng.shuffle(kinds)
    programs, t = [], 0.0
    for i, kind in enumerate(kinds):
        if i:
            t += rng.expovariate(sz.rate) if sz.rate > 0 else 0.0
        ask = encode(f"<|im_start|>user\nTask {i}: {_TASKS[i % len(_TASKS)]}<|im_end|>\n<|im_start|>assistant\n")
        if kind == "fanout":
            branches = [encode(f"<|im_end|>\n<|im_start|>user\nPart {b} of the plan: do it.<|im_end|>\n"
                               "<|im_start|>assistant\n") for b in range(sz.fanout_branches)]
            reduce = encode("<|im_end|>\n<|im_start|>user\nCombine the parts above.<|im_end|>\n<|im_start|>assistant\n")
            programs.append(Program(kind, t, [[ask], branches, [reduce]], [False, True, False], [0.0, 0.0, 0.0]))
            continue
        lo, hi = sz.coding_turns if kind == "coding" else sz.bfcl_turns
        turns = rng.randint(lo, hi)
        steps, pauses = [[ask]], []
        for _ in range(turns - 1):
            calls = 1 if kind == "coding" else rng.randint(*sz.bfcl_calls)
            size = sz.coding_result if kind == "coding" else sz.bfcl_result
            result = []
            for _ in range(calls):
                result += _text_ids(encode, rng, rng.randint(*size), kind)
            steps.append([tool_open + result + tool_close])
            pauses.append(max(_pause(rng, sz) for _ in range(calls)))
        programs.append(Program(kind, t, steps, [False] * turns, pauses + [0.0]))
    return ProgramTrace(system, programs, sz)


class _Recorder:
    def __init__(self, trace: ProgramTrace):
        self.trace = trace
        self.sent: list = []  # (when, prompt, reply)
        self.ttfts: list[float] = []
        self.prompt_tokens = self.cached_tokens = 0
        self.replies: dict = {}
        self.done: dict[int, float] = {}
        self.most_passed = 0

    def call(self, key, ready: float, prompt: list, ids: list, first: float | None, cached: int, passed: int = 0):
        self.sent.append((ready, prompt, ids))
        self.prompt_tokens += len(prompt)
        self.cached_tokens += cached
        if first is not None:
            self.ttfts.append(first - ready)
        self.replies[key] = ids
        self.most_passed = max(self.most_passed, passed)

    def summary(self, t0: float) -> dict:
        jct = {i: self.done[i] - (t0 + p.arrival) for i, p in enumerate(self.trace.programs) if i in self.done}
        prefill = self.prompt_tokens - self.cached_tokens
        new = sum(new_prompt_tokens([(p, r) for _, p, r in sorted(self.sent, key=lambda x: x[0])]))
        digest = json.dumps(sorted((list(k), v) for k, v in self.replies.items()))
        by_kind = {}
        for kind in ("coding", "bfcl", "fanout"):
            xs = [v for i, v in jct.items() if self.trace.programs[i].kind == kind]
            if xs:
                by_kind[kind] = round(sum(xs) / len(xs), 3)
        values = list(jct.values())
        return {"programs": len(self.trace.programs), "completed": len(jct), "calls": len(self.sent),
                "jct_mean_s": round(sum(values) / len(values), 3) if values else 0.0,
                "jct_p95_s": round(_pct(values, 0.95), 3), "jct_by_kind_s": by_kind,
                "jct_s": [round(jct[i], 3) for i in sorted(jct)],
                "ttft_p50_s": round(_pct(self.ttfts, 0.5), 4), "ttft_p95_s": round(_pct(self.ttfts, 0.95), 4),
                "prompt_tokens": self.prompt_tokens, "prefill_tokens": prefill, "new_tokens": new,
                "reprefilled_tokens": prefill - new, "most_passed": self.most_passed,
                "outputs_digest": hashlib.sha256(digest.encode()).hexdigest()[:16]}


def _prompts(p: Program, k: int, context: list, replies: list) -> list:
    """Step ``k``'s prompts: the context plus each call's suffix (the first after a fan-out's replies)."""
    calls = p.steps[k]
    joined = [t for r in replies for t in r] if k and p.joins[k - 1] else []
    return [context + (joined if j == 0 else []) + s for j, s in enumerate(calls)]


def run_parallm_programs(engine, trace: ProgramTrace, named: bool) -> dict:
    """``named``: every call names its program, a run's main thread its session (the engine's defaults)."""
    sz = trace.sizes
    rec = _Recorder(trace)

    async def call(i, k, j, prompt, main: bool):
        loop = asyncio.get_running_loop()
        ready = time.perf_counter()
        kw = {"program": f"p{i}", "session": f"p{i}" if main else None} if named else {}
        handle = engine.submit(prompt, loop=loop, max_tokens=sz.reply_tokens, temperature=0.0, ignore_eos=True, **kw)
        ids, first, cached = [], None, 0
        async for d in handle:
            if d.token_ids:
                first = first or time.perf_counter()
                ids += d.token_ids
            if d.usage is not None:
                cached = d.usage.cached_tokens
        seqs = handle.request.sequences
        rec.call((i, k, j), ready, prompt, ids, first, cached, seqs[0].passed if seqs else 0)
        return ids

    async def program(i: int, t0: float):
        p = trace.programs[i]
        await asyncio.sleep(max(0.0, t0 + p.arrival - time.perf_counter()))
        context, replies = list(trace.system), []
        for k, calls in enumerate(p.steps):
            prompts = _prompts(p, k, context, replies)
            replies = await asyncio.gather(*(call(i, k, j, q, len(calls) == 1) for j, q in enumerate(prompts)))
            if len(calls) == 1:
                context = prompts[0] + replies[0]
            if p.pauses[k]:
                await asyncio.sleep(p.pauses[k])
        rec.done[i] = time.perf_counter()

    async def main():
        t0 = time.perf_counter()
        await asyncio.gather(*(program(i, t0) for i in range(len(trace.programs))))
        return t0

    out = rec.summary(asyncio.run(main()))
    assert out["reprefilled_tokens"] >= 0, out
    return out


def run_mlx_lm_programs(model, trace: ProgramTrace) -> dict:
    """mlx-lm's ``BatchGenerator`` + ``LRUPromptCache`` as ``mlx_lm.server`` drives them (one entry per program
    + 1; its server's batch sizes), single-threaded: admit the calls whose time has come, then ``next()``."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import LRUPromptCache

    sz = trace.sizes
    rec = _Recorder(trace)
    lru = LRUPromptCache(max_size=len(trace.programs) + 1)
    gen = BatchGenerator(model, max_tokens=sz.reply_tokens, stop_tokens=None, completion_batch_size=32,
                         prefill_batch_size=8, prefill_step_size=2048)
    n_sys = len(trace.system)
    t0 = time.perf_counter()
    ready = [(t0 + p.arrival, i, 0) for i, p in enumerate(trace.programs)]
    heapq.heapify(ready)
    state = {i: {"context": list(trace.system), "replies": [], "left": 0, "out": {}} for i in range(len(trace.programs))}
    live: dict = {}
    while len(rec.done) < len(trace.programs):
        now = time.perf_counter()
        while ready and ready[0][0] <= now:
            at, i, k = heapq.heappop(ready)
            st = state[i]
            prompts = _prompts(trace.programs[i], k, st["context"], st["replies"])
            st["left"], st["out"], st["prompts"] = len(prompts), {}, prompts
            for j, prompt in enumerate(prompts):
                uid, cached, types = server_insert(gen, lru, "m", prompt, n_sys, sz.reply_tokens)
                live[uid] = {"key": (i, k, j), "ready": at, "prompt": prompt, "ids": [], "first": None,
                             "cached": cached, "types": types}
        if not live:
            if ready:
                time.sleep(max(0.0, ready[0][0] - time.perf_counter()))
            continue
        responses = server_step(gen, lru, "m", live)
        now = time.perf_counter()
        for r in responses:
            c = live[r.uid]
            c["first"] = c["first"] or now
            c["ids"].append(int(r.token))
            if r.finish_reason is None:
                continue
            lru.insert_cache("m", r.all_tokens[:], r.prompt_cache, cache_type="assistant")
            del live[r.uid]
            i, k, j = c["key"]
            rec.call(c["key"], c["ready"], c["prompt"], c["ids"], c["first"], c["cached"])
            st, p = state[i], trace.programs[i]
            st["out"][j] = c["ids"]
            st["left"] -= 1
            if st["left"]:
                continue
            st["replies"] = [st["out"][j] for j in range(len(st["out"]))]
            if len(p.steps[k]) == 1:
                st["context"] = st["prompts"][0] + st["replies"][0]
            if k + 1 < len(p.steps):
                heapq.heappush(ready, (now + p.pauses[k], i, k + 1))
            else:
                rec.done[i] = now
    gen.close()
    return rec.summary(t0)


def _ratio(a, b):
    return round(a / b, 2) if b else None


def run_programs(engine, sizes: ProgramSizes = FULL_PROGRAMS, tick=None, on_engine=None) -> dict:
    from parallm_engine.core.admission_order import MAX_PASSES
    from parallm_engine.core.engine import Engine

    tick = tick or (lambda msg: None)
    on_engine = on_engine or engine.run_on_engine_thread
    trace = build_trace(lambda s: engine.encode(s, add_special_tokens=False), sizes)
    longest = [trace.longest_context(p) for p in trace.programs]
    if max(longest) >= engine.context_window:
        raise ValueError(f"programs reach {max(longest)} tokens; the context window is {engine.context_window}")
    per_token = engine._scheduler.kv.kv_bytes_per_token
    working_set = (len(trace.system) + sum(n - len(trace.system) for n in longest)) * per_token
    budget = working_set // 3
    model, backend = engine.model_info.source, engine.backend.name
    out: dict = {"trace": trace.describe(), "working_set_bytes": working_set, "kv_budget_bytes": budget,
                 "max_passes_bound": MAX_PASSES}
    for name, kw in (("tight", {"kv_budget_bytes": budget}), ("roomy", {})):
        row = {}
        for mode in ("fifo", "programs"):
            tick(f"programs: {name} budget, {mode}")
            eng = Engine(model, backend=backend, kv_disk=0, **({"session_ttl": 0} if mode == "fifo" else {}), **kw)
            try:
                eng.generate([trace.system[:8]], max_tokens=2, temperature=0)  # warm-up
                row[mode] = run_parallm_programs(eng, trace, named=mode == "programs")
            finally:
                eng.shutdown()
        f, p = row["fifo"], row["programs"]
        row["same_outputs"] = f["outputs_digest"] == p["outputs_digest"]
        row["ratios"] = {"jct_mean": _ratio(f["jct_mean_s"], p["jct_mean_s"]),
                         "jct_p95": _ratio(f["jct_p95_s"], p["jct_p95_s"]),
                         "reprefill": _ratio(f["reprefilled_tokens"], p["reprefilled_tokens"]),
                         "ttft_p50": _ratio(f["ttft_p50_s"], p["ttft_p50_s"]),
                         # the program slowed most against fifo (with room: within noise of 1)
                         "worst_program_slowdown": round(max(b / a for a, b in zip(f["jct_s"], p["jct_s"]) if a), 2)}
        out[name] = row
    tick("programs: mlx-lm BatchGenerator (+LRUPromptCache)")
    out["mlx_lm_batch"] = on_engine(lambda: run_mlx_lm_programs(engine.model, trace))
    out["vs_mlx_lm"] = {"jct_mean": _ratio(out["mlx_lm_batch"]["jct_mean_s"], out["roomy"]["programs"]["jct_mean_s"]),
                        "jct_p95": _ratio(out["mlx_lm_batch"]["jct_p95_s"], out["roomy"]["programs"]["jct_p95_s"])}
    return out


def format_lines(r: dict) -> list[str]:
    t = r["trace"]
    kinds = ", ".join(f"{n} {k}" for k, n in t["programs"].items())
    lines = [f"programs: {kinds} ({t['calls']} calls), {t['system_prompt_tokens']}-token system prompt, contexts up "
             f"to {t['longest_context_tokens']} tokens, pauses log-normal median {t['pause_median_s']:g} s, "
             f"Poisson {t['rate']}/s; KV budget {r['kv_budget_bytes'] / 2**20:.0f} MiB (a third of the working set) "
             f"and the default"]
    for name in ("tight", "roomy"):
        row = r[name]
        for mode in ("fifo", "programs"):
            s = row[mode]
            lines.append(f"  {name:5} {mode:8}: JCT mean {s['jct_mean_s']:.2f} p95 {s['jct_p95_s']:.2f} s "
                         f"{s['jct_by_kind_s']}, re-prefilled {s['reprefilled_tokens']} (prefilled {s['prefill_tokens']}, "
                         f"new {s['new_tokens']}), TTFT p50 {s['ttft_p50_s']:.3f} s, most passed {s['most_passed']}")
        x = row["ratios"]
        lines.append(f"  {name:5}: fifo / programs JCT mean {x['jct_mean']}x p95 {x['jct_p95']}x, re-prefilled "
                     f"{x['reprefill']}x, TTFT p50 {x['ttft_p50']}x; worst program {x['worst_program_slowdown']}x "
                     f"fifo's; same outputs {row['same_outputs']}; bound {r['max_passes_bound']} passes")
    m = r["mlx_lm_batch"]
    lines.append(f"  mlx-lm BatchGenerator: JCT mean {m['jct_mean_s']:.2f} p95 {m['jct_p95_s']:.2f} s, re-prefilled "
                 f"{m['reprefilled_tokens']}; its JCT / ParaLLM's (roomy) mean {r['vs_mlx_lm']['jct_mean']}x "
                 f"p95 {r['vs_mlx_lm']['jct_p95']}x")
    return lines

