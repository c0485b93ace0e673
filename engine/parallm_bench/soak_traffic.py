"""The soak's request mix (bench_soak.py): seeded client workers that drive a ParaLLM server over loopback
with what agent frameworks send on every route (chat completions, Anthropic Messages, Responses, embeddings,
a LoRA adapter served as its own model), plus the faults they cause. Every request records its HTTP status, whether
that status was expected for its kind, and (streams) time to first token and inter-token gaps."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

#: A system prompt long enough that fan-outs share a real prefix (and a small KV budget must evict it).
SYSTEM = ("You are a careful assistant inside an agent framework. Answer briefly and precisely. " * 12).strip()
QUESTIONS = [
    "What is the capital of France?", "Name a primary colour.", "What is 7 times 6?", "Define recursion briefly.",
    "Give one synonym for fast.", "What does CPU stand for?", "Name a planet.", "Spell cat backwards.",
    "What is the opposite of hot?", "Name a fruit that is yellow.", "How many legs has a spider?",
    "What language is spoken in Spain?",
]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANSWER_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}, "confident": {"type": "boolean"}},
    "required": ["answer", "confident"]}}}

#: Kinds of traffic and their weights in the mix.
MIX = {"agent": 4, "fanout": 2, "chat_stream": 3, "tools": 2, "json": 1, "n2": 1, "seeded": 1, "speculative": 1,
       "disconnect": 1, "cancel": 1, "bad": 1, "long": 1, "messages": 2, "responses": 2, "embeddings": 1, "lora": 1}
#: The name a soak server serves its LoRA adapter under (soak.py writes a random one for the model).
ADAPTER = "soak-adapter"
#: Probes re-sent every interval: their text must never change (greedy, and seeded sampling).
PROBES = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0, "max_tokens": 24},
    {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a planet."}],
     "temperature": 0, "max_tokens": 24},
    {"messages": [{"role": "user", "content": "Write a short line about the sea."}], "temperature": 0.9,
     "seed": 1234, "max_tokens": 24},
]
#: Probes under the LoRA adapter (sent when the server has it).
ADAPTER_PROBES = [
    {"model": ADAPTER, "messages": [{"role": "user", "content": "Name a fruit that is yellow."}], "temperature": 0,
     "max_tokens": 24},
]


def expected(status: int, ok=(200,)) -> bool:
    """A status is expected when its kind asked for it, or it is 429: the queue is full (bursts fill it for
    everyone), which a well-behaved server answers and a client retries."""
    return status in ok or status == 429


@dataclass
class Outcome:
    kind: str
    status: int  # HTTP status; 0 for a connection error; 499 for a client that gave up on purpose
    expected: bool
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)


class Traffic:
    """Client workers; ``outcomes`` fills as requests end (the driver reads and empties it per interval)."""

    def __init__(self, client, seed: int, workers: int, max_queue: int, model: str, adapter: bool = False):
        self.client = client  # httpx.AsyncClient on the server's base URL
        self.adapter = adapter  # the server serves ADAPTER (the "lora" kind runs only then)
        self.rng = random.Random(seed)
        self.workers = workers
        self.max_queue = max_queue
        self.model = model
        self.outcomes: list[Outcome] = []
        self.stopping = False
        self.errors: list[str] = []  # client-side exceptions (connection errors), for the report
        self._histories: dict[int, list[dict]] = {}

    def body(self, **kw) -> dict:
        return {"model": self.model, **kw}

    async def run(self) -> None:
        await asyncio.gather(*(self._worker(i) for i in range(self.workers)))

    async def _worker(self, i: int) -> None:
        rng = random.Random(self.rng.random())
        kinds, weights = zip(*((k, w) for k, w in MIX.items() if self.adapter or k != "lora"))
        while not self.stopping:
            kind = rng.choices(kinds, weights)[0]
            try:
                await getattr(self, f"_{kind}")(rng, i)
            except Exception as exc:  # noqa: BLE001  a connection error is an outcome, not a crash
                self.outcomes.append(Outcome(kind, 0, False))
                self.errors.append(f"{kind}: {exc!r}")

    async def burst(self) -> int:
        """More requests than the queue holds, at once: some must get 429 (the rest finish)."""
        n = self.max_queue * 2
        results = await asyncio.gather(*(self._post("burst", self.body(
            messages=[{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}], max_tokens=2, temperature=0),
            ok=(200, 429)) for k in range(n)))
        return sum(1 for r in results if r == 429)

    # -- the kinds ------------------------------------------------------------------------------
    async def _post(self, kind: str, body: dict, ok=(200,), path="/v1/chat/completions") -> int:
        r = await self.client.post(path, json=body)
        self.outcomes.append(Outcome(kind, r.status_code, expected(r.status_code, ok)))
        return r.status_code

    async def _stream(self, kind: str, body: dict, stop_after: int | None = None,
                      path: str = "/v1/chat/completions") -> None:
        t0 = time.perf_counter()
        first, last, gaps, chunks = None, None, [], 0
        async with self.client.stream("POST", path, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                self.outcomes.append(Outcome(kind, r.status_code, expected(r.status_code)))
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                first = first if first is not None else now - t0
                if last is not None:
                    gaps.append(now - last)
                last = now
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    break  # leaving the block closes the connection mid-stream: the server must abort it
        self.outcomes.append(Outcome(kind, 499 if stop_after else 200, True, first, gaps))

    async def _agent(self, rng, i: int) -> None:
        """One turn of an agent loop whose history grows (and restarts after a few turns)."""
        history = self._histories.setdefault(i, [{"role": "system", "content": SYSTEM}])
        history.append({"role": "user", "content": rng.choice(QUESTIONS)})
        r = await self.client.post("/v1/chat/completions", json=self.body(
            messages=history, max_tokens=rng.randint(8, 24), temperature=0))
        self.outcomes.append(Outcome("agent", r.status_code, expected(r.status_code)))
        if r.status_code == 200:
            history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})
        if r.status_code != 200 or len(history) > 9:
            self._histories.pop(i, None)

    async def _fanout(self, rng, i: int) -> None:
        await asyncio.gather(*(self._stream("fanout", self.body(
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            max_tokens=12, temperature=0)) for q in rng.sample(QUESTIONS, 4)))

    async def _long(self, rng, i: int) -> None:
        """Three long generations at once (EOS ignored): rows that grow past the small KV budget while
        they decode, so the least urgent is preempted and resumes from the prefix cache."""
        seed = rng.randrange(1 << 30)
        await asyncio.gather(*(self._post("long", self.body(
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell a long story."}],
            max_tokens=160, ignore_eos=True, temperature=0.7, seed=seed + k)) for k in range(3)))

    async def _chat_stream(self, rng, i: int) -> None:
        await self._stream("chat_stream", self.body(messages=[{"role": "user", "content": rng.choice(QUESTIONS)}],
                                               max_tokens=rng.randint(8, 32)))

    async def _tools(self, rng, i: int) -> None:
        await self._post("tools", self.body(
            messages=[{"role": "user", "content": f"What is the weather in {rng.choice(['Paris', 'Oslo', 'Lima'])}?"}],
            tools=[WEATHER_TOOL], tool_choice=rng.choice(["auto", "required"]), max_tokens=32, temperature=0))

    async def _json(self, rng, i: int) -> None:
        await self._post("json", self.body(messages=[{"role": "user", "content": rng.choice(QUESTIONS)}],
                                           response_format=ANSWER_SCHEMA, max_tokens=40, temperature=0))

    async def _n2(self, rng, i: int) -> None:
        await self._post("n2", self.body(messages=[{"role": "user", "content": rng.choice(QUESTIONS)}],
                                         n=2, max_tokens=12, temperature=0.8, seed=rng.randrange(1 << 30)))

    async def _seeded(self, rng, i: int) -> None:
        await self._post("seeded", self.body(messages=[{"role": "user", "content": rng.choice(QUESTIONS)}],
                                             max_tokens=16, temperature=1.0, top_p=0.9, seed=rng.randrange(1 << 30)))

    async def _speculative(self, rng, i: int) -> None:
        text = json.dumps({"city": "Paris", "temp": 21, "unit": "C", "sky": "clear"})
        await self._post("speculative", self.body(
            messages=[{"role": "user", "content": f"Repeat this JSON exactly: {text}"}], max_tokens=32,
            temperature=0, speculative="ngram"))

    async def _disconnect(self, rng, i: int) -> None:
        await self._stream("disconnect", self.body(messages=[{"role": "user", "content": rng.choice(QUESTIONS)}],
                                                   max_tokens=64, temperature=0), stop_after=2)

    async def _cancel(self, rng, i: int) -> None:
        """A client that times out before the answer (its task is cancelled mid-request)."""
        body = self.body(messages=[{"role": "user", "content": rng.choice(QUESTIONS)}], max_tokens=64)
        try:
            r = await asyncio.wait_for(self.client.post("/v1/chat/completions", json=body), rng.uniform(0.05, 0.5))
            self.outcomes.append(Outcome("cancel", r.status_code, expected(r.status_code)))
        except asyncio.TimeoutError:
            self.outcomes.append(Outcome("cancel", 499, True))

    async def _messages(self, rng, i: int) -> None:
        """Anthropic Messages (what langchain-anthropic / the anthropic SDK send): a system prompt, sometimes a
        tool (forced or not), streamed or not."""
        body = self.body(system=SYSTEM, messages=[{"role": "user", "content": rng.choice(QUESTIONS)}],
                         max_tokens=rng.randint(8, 32), temperature=0)
        if rng.random() < 0.5:
            tool = WEATHER_TOOL["function"]
            body["tools"] = [{"name": tool["name"], "description": tool["description"],
                              "input_schema": tool["parameters"]}]
            body["tool_choice"] = rng.choice([{"type": "auto"}, {"type": "tool", "name": tool["name"]}])
        if rng.random() < 0.5:
            await self._stream("messages", body, path="/v1/messages")
        else:
            await self._post("messages", body, path="/v1/messages")

    async def _responses(self, rng, i: int) -> None:
        """OpenAI Responses (the Agents SDK's default model): instructions, sometimes a function tool, streamed
        or not; max_output_tokens small enough that some answers are cut (status incomplete: still a 200)."""
        body = self.body(instructions=SYSTEM, input=rng.choice(QUESTIONS), max_output_tokens=rng.randint(8, 32),
                         temperature=0)
        if rng.random() < 0.5:
            tool = WEATHER_TOOL["function"]
            body["tools"] = [{"type": "function", "name": tool["name"], "description": tool["description"],
                              "parameters": tool["parameters"]}]
            body["tool_choice"] = rng.choice(["auto", "required"])
        if rng.random() < 0.5:
            await self._stream("responses", body, path="/v1/responses")
        else:
            await self._post("responses", body, path="/v1/responses")

    async def _embeddings(self, rng, i: int) -> None:
        """A batch of texts to /v1/embeddings on the served model (mean pooling: any decoder embeds)."""
        texts = [rng.choice(QUESTIONS) + f" ({k})" for k in range(rng.randint(1, 16))]
        await self._post("embeddings", self.body(input=texts, pooling="mean"), path="/v1/embeddings")

    async def _lora(self, rng, i: int) -> None:
        """A chat under the LoRA adapter (served as its own model), streamed or not, beside base rows."""
        body = {"model": ADAPTER, "messages": [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": rng.choice(QUESTIONS)}],
                "max_tokens": rng.randint(8, 24), "temperature": 0}
        if rng.random() < 0.5:
            await self._stream("lora", body)
        else:
            await self._post("lora", body)

    async def _bad(self, rng, i: int) -> None:
        bad = rng.choice([
            self.body(messages=[{"role": "user", "content": "hi"}], temperature=-1),
            self.body(messages=[{"role": "user", "content": "hi"}], top_p=0),
            self.body(messages="not a list"),
            self.body(messages=[{"role": "user", "content": "hi"}], max_tokens="many"),
            self.body(messages=[{"role": "user", "content": "x " * 20000}], max_tokens=4),  # over the context
            {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        ])
        r = await self.client.post("/v1/chat/completions", json=bad)
        self.outcomes.append(Outcome("bad", r.status_code, 400 <= r.status_code < 500))



async def probe(client, model: str, adapter: bool = False) -> list[str]:
    """The probes' texts (greedy and seeded requests, the base model's and with ``adapter`` the LoRA
    adapter's, whose answers must never change)."""
    async def one(p: dict) -> str:
        r = await client.post("/v1/chat/completions", json={"model": model, **p})
        return r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"HTTP {r.status_code}"

    probes = PROBES + (ADAPTER_PROBES if adapter else [])
    return list(await asyncio.gather(*(one(p) for p in probes)))  # together: a batch must not change them
