"""The ``agents`` workload of `parallm bench`: simulated ReAct agents arriving over time.

Each of ``agents`` agents (default 16) runs a loop of ``min_turns``-``max_turns`` turns (4-6) over one
shared system prompt of ``system_tokens`` tokens (~1,500: instructions and JSON tool schemas). Turn 1
asks the agent's task; every later turn's prompt is the previous prompt + the model's reply (its token
ids, as generated) + a tool result of ``tool_min``-``tool_max`` tokens (200-800), and asks again. Agents
arrive as a Poisson process of ``rate`` agents per second. Replies are ``reply_tokens`` long, greedy,
EOS ignored, so every system runs the same amount of work. The trace (system prompt, tasks, tool
results, arrival times, turn counts) comes from ``seed`` alone; ``trace.digest`` identifies it, and
each system's ``outputs_digest`` its replies (greedy: reproducible run to run).

Prompts are token ids in ChatML (``<|im_start|>role ... <|im_end|>``, the default model's format), so
every system sees the same ids. Systems:

- ``parallm``: the engine's Python API (``engine.submit`` with token-id prompts, streamed), its radix
  prefix cache starting empty.
- ``mlx_lm_batch``: mlx-lm's ``BatchGenerator`` with its ``LRUPromptCache`` driven the way
  ``mlx_lm.server`` drives them (nearest cached prefix fetched per request, the system prompt its own
  segment so its cache is saved when prefilled, each finished request's cache stored; the server's
  batch sizes), in this process on the same weights; cache entries: one per agent + 1 (its server's
  default is 10).
- ``llama_cpp``: llama.cpp's ``llama-server`` (see ``bench_llamacpp``) on the same GGUF, one slot per
  agent, through its native ``/completion`` endpoint (``return_tokens``, so the next prompt holds the
  reply's exact ids; ``cache_prompt`` on, as by default). Only where llama-server is found.

Each entry: ``goodput_runs_per_min`` (completed agent runs / the time from the first arrival to the
last completion x 60), ``makespan_s``, ``agent_latency_p50_s`` / ``_p99_s`` (arrival to last token),
``ttft_p50_s`` / ``_p99_s`` (each turn, from its request to its first token), ``itl_p50_s`` /
``_p99_s``, ``prefix_hit_rate`` (prompt tokens served from a cache / prompt tokens), ``prompt_tokens``,
``prefill_tokens`` (prompt tokens not served from a cache), ``new_tokens`` (prompt tokens no earlier request
had computed: :func:`new_prompt_tokens`), ``reprefilled_tokens`` (``prefill_tokens - new_tokens``: computed
again although computed before), ``tokens``, ``requests``, ``peak_mem_mb`` (MLX, in-process systems),
``ttfts_s`` (every turn's TTFT, in completion order: the TTFT CDF of ``parallm bench --plot``).
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import json
import random
import time
from dataclasses import asdict, dataclass, field

import mlx.core as mx

from parallm_bench.bench import _pct


@dataclass
class AgentSizes:
    agents: int = 16
    min_turns: int = 4
    max_turns: int = 6
    system_tokens: int = 1500
    tool_min: int = 200
    tool_max: int = 800
    reply_tokens: int = 24
    rate: float = 1.0  # agent arrivals per second (Poisson)
    tool_delay_s: float = 0.0  # time a tool takes before the next turn is asked
    seed: int = 2024


FULL_AGENTS = AgentSizes()
QUICK_AGENTS = AgentSizes(agents=4, min_turns=2, max_turns=3, system_tokens=300, tool_min=40, tool_max=120,
                          reply_tokens=8, rate=4.0)

_WORDS = ("alpha bravo cache delta engine filter graph harbor index jacket kernel ledger matrix network orbit "
          "packet query router signal table update vector window yield zone amber basil cedar dune ember fjord "
          "glacier heron iris juniper kelp lotus maple nectar olive pebble quartz river sage thistle umber "
          "violet willow").split()
_TOOLS = ("search_web", "read_file", "write_file", "run_python", "query_database", "send_email", "get_weather",
          "list_directory", "fetch_url", "calendar_lookup", "translate_text", "summarize_document",
          "create_ticket", "get_stock_price", "geocode_address", "convert_units")
_TASKS = ("Find the three largest files in the project and summarise what they do.",
          "Book a meeting with the data team next Tuesday and email the agenda.",
          "Compare the weather in Lisbon and Oslo for the coming weekend.",
          "Look up yesterday's failed orders in the database and open a ticket for each.",
          "Translate the release notes to German and save them next to the English ones.",
          "Check the stock price of three cloud providers and write a short report.",
          "Fetch the changelog of the web framework and list the breaking changes.",
          "Convert the recipe quantities to metric units and save the new version.")


@dataclass
class AgentTrace:
    system: list[int]
    arrivals: list[float]  # seconds after the start
    questions: list[list[int]]
    tools: list[list[list[int]]]  # per agent: the tool result appended after each turn but the last
    sizes: AgentSizes = field(repr=False)

    @property
    def turns(self) -> list[int]:
        return [len(t) + 1 for t in self.tools]

    def digest(self) -> str:
        h = hashlib.sha256(json.dumps([self.system, self.arrivals, self.questions, self.tools]).encode())
        return h.hexdigest()[:16]

    def max_conversation(self) -> int:
        """The longest prompt + reply any agent reaches (for sizing a server's slots)."""
        return max(len(self.system) + len(q) + sum(map(len, t)) + (len(t) + 1) * self.sizes.reply_tokens
                   for q, t in zip(self.questions, self.tools))

    def describe(self) -> dict:
        return {**asdict(self.sizes), "digest": self.digest(), "turns_per_agent": self.turns,
                "arrivals_s": [round(a, 3) for a in self.arrivals], "system_prompt_tokens": len(self.system),
                "tool_result_tokens": sum(len(x) for t in self.tools for x in t),
                "requests": sum(self.turns), "longest_conversation_tokens": self.max_conversation()}


def _text_ids(encode, rng: random.Random, n: int, kind: str) -> list[int]:
    """Exactly ``n`` token ids of plausible tool output (JSON records of words and numbers)."""
    ids: list[int] = []
    while len(ids) < n:
        rec = {"id": rng.randrange(10**6), "kind": kind, "title": " ".join(rng.choices(_WORDS, k=rng.randint(2, 5))),
               "score": round(rng.random(), 3), "text": " ".join(rng.choices(_WORDS, k=rng.randint(8, 24)))}
        ids += encode(json.dumps(rec) + "\n")
    return ids[:n]


def _tool_schema(name: str, rng: random.Random) -> dict:
    params = {f"{w}_{i}": {"type": rng.choice(["string", "integer", "boolean"]),
                           "description": " ".join(rng.choices(_WORDS, k=rng.randint(4, 10)))}
              for i, w in enumerate(rng.sample(_WORDS, rng.randint(2, 4)))}
    return {"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ')}: " + " ".join(rng.choices(_WORDS, k=12)),
        "parameters": {"type": "object", "properties": params, "required": list(params)[:1]}}}


def system_prompt_ids(encode, rng: random.Random, tokens: int) -> list[int]:
    """A ChatML system message of exactly ``tokens`` ids: an agent's instructions and JSON tool schemas."""
    head = encode("<|im_start|>system\nYou are a helpful agent. Think step by step, call one tool at a time "
                  "with a JSON object, read its result, and answer when you are done. Tools:\n")
    tail = encode("<|im_end|>\n")
    body: list[int] = []
    i = 0
    while len(head) + len(body) + len(tail) < tokens:
        name = _TOOLS[i % len(_TOOLS)] + (f"_{i // len(_TOOLS)}" if i >= len(_TOOLS) else "")
        body += encode(json.dumps(_tool_schema(name, rng)) + "\n")
        i += 1
    return head + body[: max(0, tokens - len(head) - len(tail))] + tail


def build_trace(encode, sz: AgentSizes) -> AgentTrace:
    """The whole trace from ``sz.seed``; ``encode(text) -> ids`` (special tokens parsed, no BOS)."""
    rng = random.Random(sz.seed)
    system = system_prompt_ids(encode, rng, sz.system_tokens)
    open_tool, close_tool = encode("<|im_end|>\n<|im_start|>tool\n"), encode("<|im_end|>\n<|im_start|>assistant\n")
    arrivals, t = [], 0.0
    questions, tools = [], []
    for a in range(sz.agents):
        if a:
            t += rng.expovariate(sz.rate) if sz.rate > 0 else 0.0
        arrivals.append(t)
        questions.append(encode(f"<|im_start|>user\nTask {a}: {_TASKS[a % len(_TASKS)]}<|im_end|>\n"
                                "<|im_start|>assistant\n"))
        turns = rng.randint(sz.min_turns, sz.max_turns)
        tools.append([open_tool + _text_ids(encode, rng, rng.randint(sz.tool_min, sz.tool_max),
                                            _TOOLS[(a + k) % len(_TOOLS)]) + close_tool for k in range(turns - 1)])
    return AgentTrace(system, arrivals, questions, tools, sz)


# -- results ---------------------------------------------------------------------------------------

def new_prompt_tokens(turns) -> list[int]:
    """Per request, how many of its prompt tokens no earlier request had computed: what no cache could have
    served. ``turns``: ``(prompt, reply)`` token ids in the order the requests were sent. A request computes
    the KV of its prompt and of its reply bar the last token (sampled, never fed back), so an earlier request
    held ``prompt + reply[:-1]``; a prompt is new past the longest prefix any earlier request held (an agent's
    previous turn; the shared system prompt after its first prefill)."""
    from parallm_engine.kv.radix_cache import common_prefix_len

    held: list[list[int]] = []
    out = []
    for prompt, reply in turns:
        seen = max((common_prefix_len(prompt, h) for h in held), default=0)
        out.append(len(prompt) - seen)
        held.append(list(prompt) + list(reply[:-1]))
    return out


class _Recorder:
    """Per-request and per-agent timings of one system's run of the trace."""

    def __init__(self, trace: AgentTrace):
        self.trace = trace
        self.ttfts: list[float] = []
        self.itls: list[float] = []
        self.tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.requests = 0
        self.done: dict[int, float] = {}
        self.replies: dict[tuple[int, int], list[int]] = {}
        self.sent: list[tuple[float, list[int], list[int]]] = []  # (when, prompt, reply) where prompts are given

    def turn(self, agent: int, k: int, prompt_len: int, ready: float, times: list[float], ids: list[int],
             cached: int, tokens: int | None = None, prompt: list[int] | None = None) -> None:
        if prompt is not None:
            self.sent.append((ready, prompt, ids))
        self.requests += 1
        self.prompt_tokens += prompt_len
        self.cached_tokens += cached
        self.tokens += len(ids) if tokens is None else tokens
        if times:
            self.ttfts.append(times[0] - ready)
            self.itls.extend(b - a for a, b in zip(times, times[1:]))
        self.replies[(agent, k)] = ids

    def summary(self, t0: float, peak_mem: int = 0) -> dict:
        arrivals = [t0 + a for a in self.trace.arrivals]
        latencies = [self.done[a] - arrivals[a] for a in sorted(self.done)]
        makespan = max(self.done.values()) - arrivals[0] if self.done else 0.0
        digest = hashlib.sha256(json.dumps(sorted((list(k), v) for k, v in self.replies.items())).encode())
        prefill = self.prompt_tokens - self.cached_tokens
        new = {}
        if self.sent and len(self.sent) == self.requests:
            sent = sorted(self.sent, key=lambda x: x[0])
            new["new_tokens"] = sum(new_prompt_tokens([(p, r) for _, p, r in sent]))
            new["reprefilled_tokens"] = prefill - new["new_tokens"]
        return {
            "agents": len(self.trace.arrivals), "completed_runs": len(self.done), "requests": self.requests,
            "makespan_s": round(makespan, 3),
            "goodput_runs_per_min": round(60.0 * len(self.done) / makespan, 2) if makespan else 0.0,
            "agent_latency_p50_s": round(_pct(latencies, 0.5), 3),
            "agent_latency_p99_s": round(_pct(latencies, 0.99), 3),
            "ttft_p50_s": round(_pct(self.ttfts, 0.5), 4), "ttft_p99_s": round(_pct(self.ttfts, 0.99), 4),
            "itl_p50_s": round(_pct(self.itls, 0.5), 4), "itl_p99_s": round(_pct(self.itls, 0.99), 4),
            "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": prefill, **new,
            "prefix_hit_rate": round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0,
            "peak_mem_mb": round(peak_mem / 2**20, 1), "outputs_digest": digest.hexdigest()[:16],
            "ttfts_s": [round(t, 4) for t in self.ttfts],  # every turn's, for the TTFT CDF (--plot)
        }


# -- ParaLLM: the engine's Python API --------------------------------------------------------------

def run_parallm_agents(engine, trace: AgentTrace, sessions: bool = False, delay=None) -> dict:
    """``sessions``: each agent's turns name its session (kv/session_pins.py); ``delay(agent, turn)``: seconds
    its tool takes before the next turn (default: the sizes' ``tool_delay_s``)."""
    sz = trace.sizes
    engine.clear_prefix_cache()
    mx.reset_peak_memory()
    rec = _Recorder(trace)

    async def agent(a: int, t0: float):
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, t0 + trace.arrivals[a] - time.perf_counter()))
        prompt = trace.system + trace.questions[a]
        for k in range(len(trace.tools[a]) + 1):
            ready = time.perf_counter()
            handle = engine.submit(prompt, loop=loop, max_tokens=sz.reply_tokens, temperature=0.0, ignore_eos=True,
                                   session=f"agent-{a}" if sessions else None)
            times, ids, cached = [], [], 0
            async for d in handle:
                if d.token_ids:
                    times.append(time.perf_counter())
                    ids += d.token_ids
                if d.usage is not None:
                    cached = d.usage.cached_tokens
            rec.turn(a, k, len(prompt), ready, times, ids, cached, prompt=prompt)
            if k < len(trace.tools[a]):
                prompt = prompt + ids + trace.tools[a][k]
                wait = delay(a, k) if delay is not None else sz.tool_delay_s
                if wait:
                    await asyncio.sleep(wait)
        rec.done[a] = time.perf_counter()

    async def main():
        t0 = time.perf_counter()
        await asyncio.gather(*(agent(a, t0) for a in range(len(trace.arrivals))))
        return t0

    t0 = asyncio.run(main())
    out = rec.summary(t0, mx.get_peak_memory())
    # The engine serves from its cache only what it computed: a prompt's cached tokens never include a new one.
    assert out["reprefilled_tokens"] >= 0, (out["prefill_tokens"], out["new_tokens"])
    return out


# -- mlx-lm: BatchGenerator + LRUPromptCache, as mlx_lm.server drives them ------------------------

def server_insert(gen, lru, key: str, prompt: list[int], n_sys: int, max_tokens: int):
    """Admit ``prompt`` as ``mlx_lm.server`` does: the nearest cached prefix fetched, the system prompt (its
    first ``n_sys`` tokens) a segment of its own so its cache is saved once prefilled. Returns (uid, cached
    tokens, the segment types whose caches :func:`server_step` saves)."""
    cache, rest = lru.fetch_nearest_cache(key, prompt)
    cached = len(prompt) - len(rest)
    if cached < n_sys:  # (mlx_lm.server: a segment per message)
        segments, types = [prompt[cached:n_sys], prompt[n_sys:]], ["system"]
    else:
        segments, types = [prompt[cached:]], []
    (uid,) = gen.insert_segments([segments], max_tokens=[max_tokens], caches=[cache], all_tokens=[prompt[:cached]])
    return uid, cached, types


def server_step(gen, lru, key: str, live: dict) -> list:
    """One ``BatchGenerator.next()``; the caches of the segments that ended are saved (``live[uid]["types"]``
    from :func:`server_insert`). Returns the step's generation responses."""
    prompt_responses, gen_responses = gen.next()
    ends = [r.uid for r in prompt_responses if r.end_of_segment and not r.end_of_prompt and live[r.uid]["types"]]
    for uid, (cache, tokens) in gen.extract_cache(ends).items():
        lru.insert_cache(key, tokens[:], cache, cache_type=live[uid]["types"].pop())
    return gen_responses


def run_mlx_lm_agents(model, trace: AgentTrace, cache_entries: int | None = None) -> dict:
    """Single-threaded like mlx_lm.server's generation thread: admit the requests whose time has come,
    then one ``BatchGenerator.next()`` (a decode step for the running rows + a prefill chunk)."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import LRUPromptCache

    sz = trace.sizes
    mx.reset_peak_memory()
    rec = _Recorder(trace)
    key = "bench-model"
    lru = LRUPromptCache(max_size=cache_entries or len(trace.arrivals) + 1)
    # mlx_lm.server's defaults: --decode-concurrency 32, --prompt-concurrency 8, --prefill-step-size 2048.
    gen = BatchGenerator(model, max_tokens=sz.reply_tokens, stop_tokens=None, completion_batch_size=32,
                         prefill_batch_size=8, prefill_step_size=2048)
    n_sys = len(trace.system)
    t0 = time.perf_counter()
    ready: list[tuple[float, int, int]] = [(t0 + a, i, 0) for i, a in enumerate(trace.arrivals)]
    heapq.heapify(ready)
    prompts = {i: trace.system + q for i, q in enumerate(trace.questions)}
    live: dict[int, dict] = {}
    while len(rec.done) < len(trace.arrivals):
        now = time.perf_counter()
        while ready and ready[0][0] <= now:
            at, a, k = heapq.heappop(ready)
            prompt = prompts[a]
            uid, cached, types = server_insert(gen, lru, key, prompt, n_sys, sz.reply_tokens)
            live[uid] = {"agent": a, "turn": k, "ready": at, "times": [], "ids": [],
                         "cached": cached, "types": types, "prompt_len": len(prompt)}
        if not live:
            if ready:
                time.sleep(max(0.0, ready[0][0] - time.perf_counter()))
            continue
        gen_responses = server_step(gen, lru, key, live)
        now = time.perf_counter()
        for r in gen_responses:
            st = live[r.uid]
            st["times"].append(now)
            st["ids"].append(int(r.token))
            if r.finish_reason is None:
                continue
            lru.insert_cache(key, r.all_tokens[:], r.prompt_cache, cache_type="assistant")
            del live[r.uid]
            a, k = st["agent"], st["turn"]
            rec.turn(a, k, st["prompt_len"], st["ready"], st["times"], st["ids"], st["cached"])
            if k < len(trace.tools[a]):
                prompts[a] = prompts[a] + st["ids"] + trace.tools[a][k]
                heapq.heappush(ready, (now + sz.tool_delay_s, a, k + 1))
            else:
                rec.done[a] = now
    gen.close()
    return rec.summary(t0, mx.get_peak_memory())


# -- llama.cpp's server ----------------------------------------------------------------------------

def run_http_agents(base_url: str, trace: AgentTrace) -> dict:
    """The trace against llama-server's native ``/completion`` (token ids in, token ids back)."""
    import httpx

    from parallm_bench.llamacpp import stream_completion

    sz = trace.sizes
    rec = _Recorder(trace)
    incomplete = [0]

    async def agent(client, a: int, t0: float):
        await asyncio.sleep(max(0.0, t0 + trace.arrivals[a] - time.perf_counter()))
        prompt = trace.system + trace.questions[a]
        for k in range(len(trace.tools[a]) + 1):
            ready = time.perf_counter()
            out = await stream_completion(client, f"{base_url}/completion", {
                "prompt": prompt, "n_predict": sz.reply_tokens, "temperature": 0.0, "stream": True,
                "ignore_eos": True, "cache_prompt": True, "return_tokens": True})
            rec.turn(a, k, len(prompt), ready, out["times"], out["ids"], out["cached_tokens"], out["tokens"])
            # llama-server streams no ids for a token that ends inside a UTF-8 character: such a reply's
            # ids are incomplete in the next prompt (counted; the prompts stay the same length otherwise).
            incomplete[0] += len(out["ids"]) != out["tokens"]
            if k < len(trace.tools[a]):
                prompt = prompt + out["ids"] + trace.tools[a][k]
                if sz.tool_delay_s:
                    await asyncio.sleep(sz.tool_delay_s)
        rec.done[a] = time.perf_counter()

    async def main():
        n = len(trace.arrivals)
        # A new connection per request: llama-server closes a connection idle for 5 s (cpp-httplib's
        # keep-alive timeout), and an agent's next turn sent on a pooled connection the server is closing
        # failed the whole trace ("Server disconnected without sending a response", twice). Loopback
        # connects cost microseconds against turns of seconds.
        limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
            t0 = time.perf_counter()
            await asyncio.gather(*(agent(client, a, t0) for a in range(n)))
            return t0

    t0 = asyncio.run(main())
    return {**rec.summary(t0), "replies_with_incomplete_ids": incomplete[0]}


# -- the workload ----------------------------------------------------------------------------------

def run_agents_workload(engine, sz: AgentSizes, tick=None, on_engine=None, with_llama_cpp: bool = True) -> dict:
    import tempfile

    from parallm_bench import llamacpp as lc

    tick = tick or (lambda msg: None)
    on_engine = on_engine or engine.run_on_engine_thread
    trace = build_trace(lambda s: engine.encode(s, add_special_tokens=False), sz)
    if trace.max_conversation() >= engine.context_window:
        raise ValueError(f"agent conversations reach {trace.max_conversation()} tokens; the context window is "
                         f"{engine.context_window}: lower system_tokens / tool_max / max_turns")
    entry: dict = {"trace": trace.describe()}
    tick("agents: parallm")
    entry["parallm"] = run_parallm_agents(engine, trace)
    engine.clear_prefix_cache()  # the agents' conversations are not needed any more
    tick("agents: mlx-lm BatchGenerator (+LRUPromptCache)")
    entry["mlx_lm_batch"] = on_engine(lambda: run_mlx_lm_agents(engine.model, trace))
    tick("agents: llama.cpp server")
    binary, gguf = lc.find_llama_server(), lc.engine_gguf(engine)
    if not with_llama_cpp:
        entry["llama_cpp"] = {"skipped": "not requested"}
    elif binary is None:
        entry["llama_cpp"] = {"skipped": lc.SKIP_HINT}
    elif gguf is None:
        entry["llama_cpp"] = {"skipped": "the model is not a GGUF file"}
    else:
        ctx = -(-(trace.max_conversation() + 64) // 256) * 256
        with tempfile.TemporaryDirectory(prefix="parallm-bench-") as logs, \
                lc.llama_server(binary, gguf, len(trace.arrivals), ctx, f"{logs}/llama.log") as srv:
            try:
                entry["llama_cpp"] = run_http_agents(srv.url, trace)
                entry["llama_cpp"]["dtype"] = lc.gguf_dtype(gguf)
            except Exception as exc:  # the peer failing mid-trace must not discard the other systems' results
                entry["llama_cpp"] = {"skipped": f"llama-server failed during the trace ({type(exc).__name__}: "
                                                 f"{exc}); its log ends: {srv.log_tail(600)!r}"}
    entry["ratios"] = agent_ratios(entry)
    return entry


def agent_ratios(entry: dict) -> dict:
    p = entry["parallm"]
    out = {}
    for name in ("mlx_lm_batch", "llama_cpp"):
        ref = entry.get(name) or {}
        if "goodput_runs_per_min" not in ref:
            continue
        out[f"goodput_vs_{name}"] = round(p["goodput_runs_per_min"] / ref["goodput_runs_per_min"], 2) \
            if ref["goodput_runs_per_min"] else None
        out[f"ttft_p99_vs_{name}"] = round(ref["ttft_p99_s"] / p["ttft_p99_s"], 2) if p["ttft_p99_s"] else None
        out[f"ttft_p50_vs_{name}"] = round(ref["ttft_p50_s"] / p["ttft_p50_s"], 2) if p["ttft_p50_s"] else None
    return out


def format_lines(entry: dict) -> list[str]:
    t = entry["trace"]
    lines = [f"agents: {t['agents']} agents x {t['min_turns']}-{t['max_turns']} turns ({t['requests']} requests), "
             f"{t['system_prompt_tokens']}-token shared system prompt, tool results {t['tool_min']}-{t['tool_max']} "
             f"tokens, {t['reply_tokens']}-token replies, Poisson arrivals {t['rate']}/s, seed {t['seed']} "
             f"(trace {t['digest']})"]
    for system in ("parallm", "mlx_lm_batch", "llama_cpp"):
        s = entry.get(system)
        if not s:
            continue
        if "skipped" in s:
            lines.append(f"  {system:12s}: skipped ({s['skipped']})")
            continue
        lines.append(f"  {system:12s}: goodput {s['goodput_runs_per_min']:6.1f} runs/min "
                     f"(makespan {s['makespan_s']:.1f} s)  TTFT p50 {s['ttft_p50_s']:.3f} p99 {s['ttft_p99_s']:.3f} s"
                     f"  ITL p50 {s['itl_p50_s'] * 1e3:.0f} "
                     f"p99 {s['itl_p99_s'] * 1e3:.0f} ms  prefix hits {s['prefix_hit_rate']:.0%}  "
                     f"agent latency p50 {s['agent_latency_p50_s']:.1f} s")
    return lines
