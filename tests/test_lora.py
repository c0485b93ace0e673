"""Many LoRA adapters in one batch: each adapter's rows equal mlx-lm running that adapter alone.

A tiny random-weight llama (``tests/model_zoo.py``) and three adapters written with mlx-lm's own LoRA
layers (``bench_lora.write_random_adapter``: two LoRA of different ranks and layers, one DoRA; non-zero
B). The reference for each adapter is ``mlx_lm.load(base, adapter_path=...)``'s greedy generation and
its own logits; the engine runs batches holding 1, 2 or 3 adapters plus base rows, on the native CPU
path and on the pure-MLX path (``cpu-mlx``).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.model_zoo import build, default_tokenizer, prompt_ids, reference_greedy

NEW = 8
ADAPTERS = {  # name -> write_random_adapter settings
    "sql": dict(rank=4, seed=1),
    "router": dict(rank=8, num_layers=1, keys=["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"], seed=2),
    "summary": dict(rank=2, dora=True, seed=3),
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    tok_dir, vocab = default_tokenizer()
    return build("llama", tmp_path_factory.mktemp("lora-base"), tok_dir, vocab)


@pytest.fixture(scope="module")
def adapter_dirs(base_dir, tmp_path_factory):
    from parallm_bench.lora import write_random_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {name: write_random_adapter(base_dir, root / name, **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def vocab(base_dir):
    return json.loads((base_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def references(base_dir, adapter_dirs, vocab):
    """Per adapter (None: the base): mlx-lm's model with that adapter loaded, greedy tokens and logprobs."""
    import mlx.core as mx
    from mlx_lm import load

    prompts = [prompt_ids(30 + 3 * i, vocab, seed=i) for i in range(4)]
    out = {}
    for name in [None, *adapter_dirs]:
        model, _ = load(str(base_dir), adapter_path=str(adapter_dirs[name]) if name else None)
        greedy = [reference_greedy(model, p, NEW) for p in prompts]
        lps = []
        for p, toks in zip(prompts, greedy):
            logits = model(mx.array(p + toks)[None])[0].astype(mx.float32)
            own = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            lps.append([own[len(p) - 1 + i, t].item() for i, t in enumerate(toks)])
        out[name] = (greedy, lps)
    out["prompts"] = prompts
    return out


def _engine(base_dir, adapter_dirs, backend, **kw):
    from parallm_engine import Engine

    return Engine(str(base_dir), adapters={k: str(v) for k, v in adapter_dirs.items()}, backend=backend,
                  max_batch_size=16, prefill_chunk=64, decode_lanes=1, **kw)


def _check(results, names, rows, references):
    for r, name, i in zip(results, names, rows):
        want_toks, want_lps = references[name][0][i], references[name][1][i]
        assert r.token_ids == want_toks, (name, i)
        for lp, want in zip(r.logprobs, want_lps):
            assert math.isclose(lp.logprob, want, abs_tol=1e-4), (name, i, lp.logprob, want)


@pytest.mark.parametrize("backend", [None, "cpu-mlx"])
def test_mixed_adapters_match_mlx_lm_alone(base_dir, adapter_dirs, references, backend):
    for name in adapter_dirs:  # every adapter changes the output (else the comparison proves nothing)
        assert references[name][0] != references[None][0], name
    eng = _engine(base_dir, adapter_dirs, backend)
    try:
        prompts = references["prompts"]
        greedy = dict(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=True)
        names = list(adapter_dirs)
        for k in (1, 2, 3):  # k adapters plus base rows in one batch; every row its own prompt
            batch = [(name, i) for j, name in enumerate(names[:k]) for i in (j, (j + 1) % 4)] + [(None, 3), (None, 0)]
            handles = [eng.submit(prompts[i], adapter=name, **greedy) for name, i in batch]
            results = [eng._collect(h) for h in handles]
            _check(results, [n for n, _ in batch], [i for _, i in batch], references)
        # One prompt under three adapters and the base at once: nothing shared across adapters in flight.
        same = [eng.submit(prompts[1], adapter=name, **greedy) for name in [*names, None]]
        _check([eng._collect(h) for h in same], [*names, None], [1] * 4, references)
        stats = eng.stats()["adapters"]
        assert set(stats["loaded"]) == set(names) and stats["loaded_bytes"] > 0 and stats["stack_bytes"] > 0
    finally:
        eng.shutdown()


def test_prefix_cache_is_per_adapter(base_dir, adapter_dirs, references, vocab):
    eng = _engine(base_dir, adapter_dirs, None)
    try:
        shared = prompt_ids(48, vocab, seed=11)
        greedy = dict(max_tokens=NEW, temperature=0, ignore_eos=True)
        first = eng.generate([shared + [300]], adapter="sql", **greedy)[0]
        assert first.usage.cached_tokens == 0
        other = eng.generate([shared + [301]], adapter="router", **greedy)[0]
        assert other.usage.cached_tokens == 0  # computed under "sql": never served to "router"
        base = eng.generate([shared + [302]], **greedy)[0]
        assert base.usage.cached_tokens == 0
        again = eng.generate([shared + [303]], adapter="sql", **greedy)[0]
        assert again.usage.cached_tokens >= 40  # the same adapter hits it
        from mlx_lm import load

        ref, _ = load(str(base_dir), adapter_path=str(adapter_dirs["sql"]))
        assert again.token_ids == reference_greedy(ref, shared + [303], NEW)
        ref_r, _ = load(str(base_dir), adapter_path=str(adapter_dirs["router"]))
        assert other.token_ids == reference_greedy(ref_r, shared + [301], NEW)
    finally:
        eng.shutdown()


def test_streaming_speculation_seed_and_peft(base_dir, adapter_dirs, references, tmp_path):
    """n-gram speculation and streaming under an adapter give the greedy tokens; a seeded adapter row is
    the same alone and in a mixed batch; the same adapter in PEFT's format gives the same tokens."""
    import mlx.core as mx

    eng = _engine(base_dir, adapter_dirs, None)
    try:
        p = references["prompts"][2]
        want = references["sql"][0][2]
        spec = eng.generate([p], adapter="sql", max_tokens=NEW, temperature=0, ignore_eos=True,
                            speculative={"method": "ngram", "num_tokens": 3, "adaptive": False})[0]
        assert spec.token_ids == want
        streamed = [t for d in eng.stream(p, adapter="sql", max_tokens=NEW, temperature=0, ignore_eos=True)
                    for t in d.token_ids]
        assert streamed == want
        seeded = dict(max_tokens=NEW, temperature=0.9, seed=7, ignore_eos=True, adapter="summary")
        alone = eng.generate([p], **seeded)[0].token_ids
        others = [eng.submit(q, adapter=a, max_tokens=NEW, temperature=0.8, ignore_eos=True)
                  for q, a in zip(references["prompts"], ["router", None, "sql", "summary"])]
        mixed = eng.generate([p], **seeded)[0].token_ids
        for h in others:
            eng._collect(h)
        assert alone == mixed

        # PEFT's layout of the "sql" adapter (scale = lora_alpha / r).
        src = adapter_dirs["sql"]
        cfg = json.loads((src / "adapter_config.json").read_text())["lora_parameters"]
        peft = tmp_path / "peft-sql"
        peft.mkdir()
        weights = {}
        for name, w in mx.load(str(src / "adapters.safetensors")).items():
            path, _, leaf = name.rpartition(".")
            weights[f"base_model.model.{path}.lora_{'A' if leaf == 'lora_a' else 'B'}.weight"] = w.T
        mx.save_safetensors(str(peft / "adapter_model.safetensors"), weights)
        (peft / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": cfg["rank"], "lora_alpha": cfg["scale"] * cfg["rank"],
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}))
        got = eng.generate([p], adapter=str(peft), max_tokens=NEW, temperature=0, ignore_eos=True)[0]
        assert got.token_ids == want

        # Tools and grammars: a forced call is a valid call under an adapter, beside a base row.
        tool = {"type": "function", "function": {"name": "run_sql", "parameters": {
            "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
        msgs = [{"role": "user", "content": "Count the orders."}]
        base_row = eng.submit(p, max_tokens=NEW, temperature=0)
        called = eng.chat(msgs, tools=[tool], tool_choice="required", adapter="router", max_tokens=48, temperature=0)
        eng._collect(base_row)
        assert called.tool_calls and called.tool_calls[0].name == "run_sql"
    finally:
        eng.shutdown()


def test_adapter_by_hf_repo_id(base_dir, adapter_dirs, references, tmp_path, monkeypatch):
    """An adapter named by HF repo id resolves through the local hub cache, as a model does (no download)."""
    import shutil

    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--acme--sql-lora"
    shutil.copytree(adapter_dirs["sql"], repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    eng = _engine(base_dir, {}, None)
    try:
        p = references["prompts"][0]
        got = eng.generate([p], adapter="acme/sql-lora", max_tokens=NEW, temperature=0, ignore_eos=True)[0]
        assert got.token_ids == references["sql"][0][0]
    finally:
        eng.shutdown()


def test_bad_adapters_are_refused(base_dir, adapter_dirs, tmp_path, vocab):
    from parallm_engine import Engine
    from parallm_bench.lora import write_random_adapter
    from parallm_engine.errors import AdapterLoadError, AdapterNotFoundError, InvalidRequestError

    tok_dir, _ = default_tokenizer()
    other_base = build("llama", tmp_path / "other", tok_dir, vocab, overrides={"hidden_size": 32, "head_dim": 8})
    foreign = write_random_adapter(other_base, tmp_path / "foreign", rank=4)
    (tmp_path / "no-config").mkdir()
    with pytest.raises(AdapterLoadError, match="does not fit"):
        Engine(str(base_dir), adapters={"foreign": str(foreign)})
    eng = _engine(base_dir, adapter_dirs, None)
    try:
        p = prompt_ids(20, vocab, seed=5)
        with pytest.raises(AdapterNotFoundError):
            eng.submit(p, adapter="nope")
        with pytest.raises(AdapterLoadError, match="does not fit"):
            eng.submit(p, adapter=str(foreign))
        with pytest.raises(AdapterLoadError, match="adapter_config.json"):
            eng.submit(p, adapter=str(tmp_path / "no-config"))
        with pytest.raises(InvalidRequestError, match="draft"):
            eng.submit(p, adapter="sql", speculative={"method": "draft", "model": str(base_dir)})
        # Nothing else was hurt: the engine still serves adapter and base rows.
        r = eng.generate([p, p], adapter="sql", max_tokens=2, temperature=0)
        assert all(len(x.token_ids) == 2 for x in r)
    finally:
        eng.shutdown()


def test_server_and_integrations_pick_adapters(base_dir, adapter_dirs, vocab):
    """The server serves each adapter as a model (vLLM's convention); ChatParaLLM, ParaLLM and
    ParaLLMLlamaIndex take ``adapter=`` as a field and per call, in-process and through ``base_url``."""
    import httpx
    from langchain_core.runnables import RunnableParallel

    from parallm_engine import get_engine
    from parallm_engine.serve.server import ServerThread
    from parallm_integrations import ChatParaLLM, ParaLLM
    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    kwargs = {"adapters": {k: str(v) for k, v in adapter_dirs.items()}, "max_batch_size": 16}
    eng = get_engine(str(base_dir), **kwargs)
    msgs = [{"role": "user", "content": "Write a query."}]
    greedy = dict(max_tokens=NEW, temperature=0, ignore_eos=True)
    want = {name: eng.chat(msgs, adapter=name, **greedy).text for name in [None, *adapter_dirs]}
    assert len(set(want.values())) == 4  # each adapter answers differently

    chat = ChatParaLLM(model=str(base_dir), engine_kwargs=kwargs, adapter="sql", **greedy)
    assert chat.invoke(msgs).content == want["sql"]
    assert chat.invoke(msgs, adapter="router").content == want["router"]  # per call
    fan = RunnableParallel(**{name: chat.bind(adapter=name) for name in adapter_dirs}).invoke(msgs)
    assert {k: v.content for k, v in fan.items()} == {k: want[k] for k in adapter_dirs}
    llm = ParaLLM(model=str(base_dir), engine_kwargs=kwargs, adapter="summary", max_tokens=NEW, temperature=0)
    prompt_text = "SELECT name FROM"
    assert llm.invoke(prompt_text) == eng.generate([prompt_text], adapter="summary", max_tokens=NEW,
                                                   temperature=0)[0].text
    li = ParaLLMLlamaIndex(model=str(base_dir), engine_kwargs=kwargs, adapter="sql", **greedy)
    from llama_index.core.llms import ChatMessage

    assert li.chat([ChatMessage(role="user", content=msgs[0]["content"])]).message.content == want["sql"]

    with ServerThread(engine=eng) as srv:
        models = httpx.get(f"{srv.base_url}/models").json()["data"]
        assert {m["id"] for m in models} >= {"sql", "router", "summary"}
        assert all(m["parent"] == models[0]["id"] for m in models[1:])
        body = {"model": "router", "messages": msgs, **greedy}
        resp = httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=60).json()
        assert resp["choices"][0]["message"]["content"] == want["router"] and resp["model"] == "router"
        missing = httpx.post(f"{srv.base_url}/chat/completions", json={**body, "model": "nope"}, timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        remote = ChatParaLLM(base_url=srv.base_url, api_key="EMPTY", adapter="summary", **greedy)
        assert remote.invoke(msgs).content == want["summary"]
        assert remote.invoke(msgs, adapter="sql").content == want["sql"]


@pytest.mark.parametrize("backend", [None, "cpu-mlx"])
def test_preemption_and_more_adapters_than_resident(base_dir, adapter_dirs, references, backend):
    """A KV budget far too small for the batch (rows are preempted and resume from the per-adapter prefix
    cache) and only two adapters kept loaded for three in use: every row still equals mlx-lm's."""
    from parallm_engine import Engine

    cfg = json.loads((base_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4  # float32 K and V
    eng = Engine(str(base_dir), adapters={k: str(v) for k, v in adapter_dirs.items()}, max_adapters=2,
                 backend=backend, decode_lanes=1, kv_budget_bytes=per_token * 160)
    try:
        prompts = references["prompts"]
        batch = [(name, i) for name in [*adapter_dirs, None] for i in range(4)]
        handles = [eng.submit(prompts[i], adapter=name, max_tokens=NEW, temperature=0, ignore_eos=True,
                              logprobs=True) for name, i in batch]
        _check([eng._collect(h) for h in handles], [n for n, _ in batch], [i for _, i in batch], references)
        stats = eng.stats()
        assert stats["preemptions"] > 0
        assert stats["adapters"]["evictions"] > 0 and len(stats["adapters"]["loaded"]) == 2
    finally:
        eng.shutdown()


@pytest.mark.parametrize("backend", [None, "cpu-mlx"])
def test_adapter_prompts_chunked_in_decode_forwards(base_dir, adapter_dirs, references, vocab, backend):
    """Long prompts under adapters prefilled chunk by chunk inside the decode forward of rows decoding under
    other adapters (a fused step: every model row its own adapter, the head on the decode rows): every
    answer equals mlx-lm's with its adapter loaded."""
    from mlx_lm import load

    eng = _engine(base_dir, adapter_dirs, backend, prefill_budget=64)
    try:
        names = list(adapter_dirs)
        prompts = references["prompts"]
        greedy = dict(max_tokens=NEW, temperature=0, ignore_eos=True)
        decoding = [eng.submit(prompts[i], adapter=name, **greedy) for i, name in enumerate([*names, None])]
        streams = [iter(h) for h in decoding]
        for st in streams:  # every row has decoded once: the long prompts arrive beside running rows
            next(st)
        fused = eng.stats()["fused_prefill_tokens"]
        longs = [(names[0], prompt_ids(150, vocab, seed=21)), (None, prompt_ids(140, vocab, seed=22)),
                 (names[2], prompt_ids(130, vocab, seed=23))]
        late = [eng.submit(p, adapter=name, **greedy) for name, p in longs]
        got = [eng._collect(h).token_ids for h in decoding]
        assert got == [references[name][0][i] for i, name in enumerate([*names, None])]
        for (name, p), h in zip(longs, late):
            model, _ = load(str(base_dir), adapter_path=str(adapter_dirs[name]) if name else None)
            assert eng._collect(h).token_ids == reference_greedy(model, p, NEW), name
        assert eng.stats()["fused_prefill_tokens"] - fused >= 128
    finally:
        eng.shutdown()


def test_mixed_cache_layout_family(tmp_path, vocab):
    """A model with sliding-window layers (the engine's "mixed" cache layout: mlx-lm's batched caches and
    whole-state prefix snapshots, per adapter) runs adapter rows beside base rows as mlx-lm does."""
    from mlx_lm import load

    from parallm_engine import Engine
    from parallm_bench.lora import write_random_adapter

    tok_dir, _ = default_tokenizer()
    base = build("gemma3_text", tmp_path / "g3", tok_dir, vocab)
    adapter = write_random_adapter(base, tmp_path / "a", rank=4, seed=9, b_std=0.004)
    prompts = [prompt_ids(20 + 7 * i, vocab, seed=20 + i) for i in range(2)]
    ref_a, _ = load(str(base), adapter_path=str(adapter))
    ref_b, _ = load(str(base))
    want = [reference_greedy(ref_a, p, NEW) for p in prompts] + [reference_greedy(ref_b, p, NEW) for p in prompts]
    assert want[:2] != want[2:]
    eng = Engine(str(base), adapters={"a": str(adapter)}, decode_lanes=1)
    try:
        assert eng._scheduler.layout == "mixed"
        for _ in range(2):  # cold, then from the per-adapter snapshots
            handles = [eng.submit(p, adapter=a, max_tokens=NEW, temperature=0, ignore_eos=True)
                       for a in ("a", None) for p in prompts]
            assert [eng._collect(h).token_ids for h in handles] == want
    finally:
        eng.shutdown()


def test_bench_lora_workload(base_dir):
    """`parallm bench --workloads lora` on a tiny model: the mixed requests decode as one batch."""
    from parallm_engine import Engine
    from parallm_bench.lora import LoraSizes, format_lines, run_lora

    eng = Engine(str(base_dir), decode_lanes=1)
    try:
        res = run_lora(eng, LoraSizes(n=8, adapters=2, prompt_len=16, new_tokens=4, rank=4, runs=1))
        assert res["peak_running_mixed"] == 8
        assert res["mixed"]["tokens"] == res["base"]["tokens"] == 8 * 4
        assert res["ratios"]["mixed_vs_base"] > 0 and "mixed adapters" in format_lines(res)[0]
    finally:
        eng.shutdown()

