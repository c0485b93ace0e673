"""Speculative decoding with a draft model (``draft_model.py``) inside the continuous batch: exactness
alone and mixed with plain and n-gram rows (and on the default model), seeded sampling independent of
batch mates, typed errors for bad drafts, draft KV freed when a row leaves. A tiny random 4-layer llama
target; drafts: its first layer (a saved directory, and the same in memory), and the target itself
(acceptance ~1)."""

from __future__ import annotations

import json
import time

import mlx.core as mx
import pytest

from parallm_engine import Engine
from parallm_engine.errors import InvalidRequestError
from parallm_engine.sampling.sampling_params import SamplingParams
from parallm_engine.sampling.spec_config import parse_speculative
from tests.model_zoo import build, default_tokenizer, prompt_ids

NEW = 28


def _draft(path, k: int = 4) -> dict:
    return {"method": "draft", "model": str(path), "num_tokens": k, "adaptive": False}  # every step drafts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target dir, first-layer draft dir, vocab size): the draft is the target's embedding, first layer,
    final norm (tied head), so it shares the target's vocabulary and some of its computation."""
    tok_dir, vocab = default_tokenizer()
    root = tmp_path_factory.mktemp("draft-pair")
    target = build("llama", root / "target", tok_dir, vocab, overrides={"num_hidden_layers": 4})
    draft = root / "draft"
    draft.mkdir()
    for f in target.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (draft / f.name).write_bytes(f.read_bytes())
    weights = mx.load(str(target / "model.safetensors"))
    keep = {k: v for k, v in weights.items() if not k.startswith(("model.layers.1.", "model.layers.2.",
                                                                   "model.layers.3."))}
    mx.save_safetensors(str(draft / "model.safetensors"), keep, metadata={"format": "mlx"})
    config = json.loads((target / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    return target, draft, vocab


@pytest.fixture(scope="module")
def eng(models):
    e = Engine(str(models[0]))
    yield e
    e.shutdown()


def _prompts(vocab: int) -> list[list[int]]:
    return [prompt_ids(40 + 7 * i, vocab, seed=i) for i in range(4)]


def test_settings_parse_and_bad_values_are_typed_errors(models):
    target, draft, _ = models
    cfg = parse_speculative(_draft(draft, 3))
    assert (cfg.method, cfg.num_tokens, cfg.enabled) == ("draft", 3, True)
    assert cfg.as_dict()["model"] == str(draft) and cfg == parse_speculative(_draft(draft, 3))
    for bad in ({"method": "draft"}, {"method": "draft", "model": str(draft / "missing")},
                {"method": "draft", "model": str(draft), "min_match": 2}, {"method": "draft", "model": 42},
                {"method": "draft", "model": str(draft), "num_tokens": 0}):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams.from_kwargs(speculative=bad)
        assert info.value.param == "speculative"


def test_draft_kv_follows_the_context_through_rejections(models):
    """The draft's proposals after partial acceptances (its KV trimmed, the accepted tokens fed) equal
    the draft model's own greedy continuation of the context computed from scratch."""
    from types import SimpleNamespace

    from mlx_lm.utils import load

    from parallm_engine.spec.draft_model import DraftModel, DraftRows
    from tests.model_zoo import reference_greedy

    _, draft, vocab = models
    model, _ = load(str(draft))
    dm = DraftModel("test", model, None, vocab, 4096, "draft")
    rows = DraftRows()
    seqs = [SimpleNamespace(request=SimpleNamespace(prompt_ids=prompt_ids(n, vocab, seed=5)), output_ids=[])
            for n in (30, 17, 41)]
    for step in range(7):
        # One row alone first (its own forwards), then all three (merged, left-padded, one forward per
        # drafted position), with different k per row.
        batch = seqs[:1] if step < 2 else seqs
        ks = [4, 2, 3][: len(batch)]
        ctxs = [s.request.prompt_ids + s.output_ids for s in batch]
        got = rows.propose([(s, dm, k) for s, k in zip(batch, ks)])
        assert got == [reference_greedy(model, ctx, k) for ctx, k in zip(ctxs, ks)]
        for r, (s, d, k) in enumerate(zip(batch, got, ks)):
            accepted = (step + r) % (k + 1)  # none, some, all (then the target's next token)
            s.output_ids += d[:accepted] + [(d[accepted] + 1) % vocab if accepted < k else 300 + step]
    assert rows.nbytes() > 0 and len(rows) == 3
    rows.drop({id(s) for s in seqs[:2]})
    assert len(rows) == 1
    rows.retain([])
    assert rows.nbytes() == 0 and len(rows) == 0


# -- exactness -----------------------------------------------------------------------------------
def test_greedy_equals_plain_alone_and_in_a_mixed_batch(eng, models):
    target, draft, vocab = models
    prompts = _prompts(vocab)
    plain = [r.token_ids for r in eng.generate(prompts, max_tokens=NEW, temperature=0)]
    alone = eng.generate(prompts[0], max_tokens=NEW, temperature=0, speculative=_draft(draft))[0]
    assert alone.token_ids == plain[0]
    assert alone.usage.spec_proposed_tokens > 0
    # The target as its own draft: (nearly) every draft is accepted.
    same = eng.generate(prompts[1], max_tokens=NEW, temperature=0, speculative=_draft(target))[0]
    assert same.token_ids == plain[1]
    assert same.usage.spec_accepted_tokens > 0.8 * same.usage.spec_proposed_tokens > 0
    # First-layer draft, plain, n-gram and target-as-draft rows in one batch.
    kinds = [_draft(draft), None, {"method": "ngram", "num_tokens": 3}, _draft(target, 2)]
    handles = [eng.submit(p, max_tokens=NEW, temperature=0, speculative=kinds[i]) for i, p in enumerate(prompts)]
    results = [Engine._collect(h) for h in handles]
    assert [r.token_ids for r in results] == plain
    # It drafted and verified next to the others; the batch's rows advance together, so with a plain row
    # beside it none of its accepted drafts may have been emitted early (they are emitted as it decodes).
    assert results[3].usage.spec_proposed_tokens > 0
    # Three rows of one draft model draft together (merged caches): still (nearly) all accepted.
    handles = [eng.submit(p, max_tokens=NEW, temperature=0, speculative=_draft(target, 2)) for p in prompts[:3]]
    results = [Engine._collect(h) for h in handles]
    assert [r.token_ids for r in results] == plain[:3]
    assert all(r.usage.spec_accepted_tokens > 0.8 * r.usage.spec_proposed_tokens > 0 for r in results)
    # Every row finished (retired after its last token was delivered, at the end of the step): no draft KV.
    assert eng.run_on_engine_thread(lambda: eng.stats()["spec_draft_kv_bytes"]) == 0


def test_greedy_equals_plain_on_the_default_model(engine):
    """The default model with a draft cut from it (its first 24 of 30 layers, built in memory as the
    bench does), alone and next to a plain row."""
    from parallm_bench.spec import copy_prompts, truncated_draft

    spec = {"method": "draft", "model": truncated_draft(engine, 24), "num_tokens": 3, "adaptive": False}
    prompts = copy_prompts(engine, 2, seed=3)
    plain = [r.token_ids for r in engine.generate(prompts, max_tokens=24, temperature=0)]
    alone = engine.generate(prompts[0], max_tokens=24, temperature=0, speculative=spec)[0]
    assert alone.token_ids == plain[0] and alone.usage.spec_accepted_tokens > 0
    handles = [engine.submit(p, max_tokens=24, temperature=0, speculative=[spec, None][i])
               for i, p in enumerate(prompts)]
    assert [Engine._collect(h).token_ids for h in handles] == plain


def test_seeded_sampling_is_the_same_alone_batched_and_without_speculation(eng, models):
    target, draft, vocab = models
    prompts = _prompts(vocab)[:3]
    kw = dict(max_tokens=24, temperature=0.8, top_p=0.95)
    plain = [eng.generate(p, seed=7 + i, **kw)[0].token_ids for i, p in enumerate(prompts)]
    alone = eng.generate(prompts[0], seed=7, speculative=_draft(target), **kw)[0]
    assert alone.token_ids == plain[0] and alone.usage.spec_accepted_tokens > 0
    kinds = [_draft(target), _draft(draft, 3), None]
    handles = [eng.submit(p, seed=7 + i, speculative=kinds[i], **kw) for i, p in enumerate(prompts)]
    assert [Engine._collect(h).token_ids for h in handles] == plain


def test_grammar_max_tokens_and_logprobs_with_a_draft(eng, models):
    target, _, vocab = models
    prompt = _prompts(vocab)[1]
    for n in (1, 2, 5):
        r = eng.generate(prompt, max_tokens=n, temperature=0, speculative=_draft(target))[0]
        assert len(r.token_ids) == n and r.finish_reason == "length"
    kw = dict(max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    plain = eng.generate(prompt, **kw)[0]
    spec = eng.generate(prompt, speculative=_draft(target), **kw)[0]
    assert spec.token_ids == plain.token_ids and spec.usage.spec_accepted_tokens > 0
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    fmt = {"type": "json_object"}  # drafts the grammar forbids are cut before verification
    plain = eng.generate(prompt, max_tokens=16, temperature=0, response_format=fmt)[0]
    spec = eng.generate(prompt, max_tokens=16, temperature=0, response_format=fmt, speculative=_draft(target))[0]
    assert spec.token_ids == plain.token_ids


def test_engine_default_with_an_in_memory_draft_and_opt_out(models):
    """``Engine(speculative=...)`` with a loaded mlx-lm model as the draft (the target's first layer)."""
    from mlx_lm.utils import load

    target, _, vocab = models
    draft_model, _ = load(str(target))
    draft_model.model.layers = draft_model.model.layers[:1]
    draft_model.args.num_hidden_layers = 1
    e = Engine(str(target), speculative={"method": "draft", "model": draft_model, "num_tokens": 3, "adaptive": False})
    try:
        prompt = _prompts(vocab)[2]
        on = e.generate(prompt, max_tokens=NEW, temperature=0)[0]
        off = e.generate(prompt, max_tokens=NEW, temperature=0, speculative=False)[0]
        assert on.token_ids == off.token_ids
        assert on.usage.spec_proposed_tokens > 0 and off.usage.spec_proposed_tokens == 0
        with pytest.raises(InvalidRequestError, match="itself"):  # the engine's own model object
            e.submit(prompt, max_tokens=4, speculative={"method": "draft", "model": e.model})
    finally:
        e.shutdown()


# -- errors and memory ---------------------------------------------------------------------------
def test_bad_drafts_are_refused_with_typed_errors(eng, models, tmp_path):
    target, _, vocab = models
    tok_dir, _ = default_tokenizer()
    other_vocab = build("llama", tmp_path / "v512", tok_dir, 512)
    sliding = build("gemma3_text", tmp_path / "g3", tok_dir, vocab)
    for bad, match in ((_draft(other_vocab), "vocabulary"), (_draft(sliding), "sliding-window"),
                       (_draft(tmp_path / "nowhere"), "no such"), (_draft(tmp_path), "config.json")):
        with pytest.raises(InvalidRequestError, match=match) as info:
            eng.submit([5, 6, 7], max_tokens=4, speculative=bad)
        assert info.value.param == "speculative"
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        Engine(str(target), speculative=_draft(other_vocab))
    assert len(eng.generate([5, 6, 7], max_tokens=4, temperature=0)[0].token_ids) == 4  # still serving


def test_cancelled_request_frees_its_draft_kv(eng, models):
    target, _, vocab = models
    handle = eng.submit(prompt_ids(60, vocab, seed=9), max_tokens=400, temperature=0, ignore_eos=True,
                        speculative=_draft(target))
    stream = iter(handle)
    for _ in range(3):
        next(stream)
    held = eng.run_on_engine_thread(lambda: eng._scheduler.speculator.draft_rows.nbytes())
    assert held > 0 and eng.stats()["spec_draft_kv_bytes"] > 0
    handle.abort()
    deadline = time.time() + 30
    while time.time() < deadline and eng.run_on_engine_thread(lambda: len(eng._scheduler.speculator.draft_rows)):
        time.sleep(0.05)
    assert eng.run_on_engine_thread(lambda: len(eng._scheduler.speculator.draft_rows)) == 0
    assert eng.stats()["spec_draft_kv_bytes"] == 0


# -- integrations and server ---------------------------------------------------------------------
def test_integrations_and_server_pass_draft_settings(eng, models, tmp_path):
    import httpx

    from parallm_engine.serve.server import ServerThread
    from parallm_integrations import ChatParaLLM
    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    target, draft, vocab = models
    with pytest.raises(ValueError, match="speculative"):
        ChatParaLLM(model=str(target), speculative=_draft(tmp_path / "nowhere"))
    llm = ChatParaLLM(model=str(target), temperature=0, max_tokens=8, speculative=_draft(draft))
    assert llm._build_request(None, {}).sampling["speculative"] == _draft(draft)
    plain_llm = ChatParaLLM(model=str(target), temperature=0, max_tokens=8)
    assert llm.invoke("Count: 1 2 3").content == plain_llm.invoke("Count: 1 2 3").content
    with pytest.raises(ValueError, match="speculative"):
        ParaLLMLlamaIndex(model=str(target), speculative={"method": "draft"})
    li = ParaLLMLlamaIndex(model=str(target), temperature=0, max_tokens=8, speculative=_draft(draft))
    assert li._build_request({}).sampling["speculative"] == _draft(draft)

    body = {"model": "default", "max_tokens": 16, "temperature": 0, "prompt": "Say: 1 2 3 4 5 6 7 8"}
    with ServerThread(engine=eng) as srv:
        plain = httpx.post(srv.base_url + "/completions", json=body, timeout=120).json()
        spec = httpx.post(srv.base_url + "/completions", json={**body, "speculative": _draft(target)},
                          timeout=120).json()
        bad = httpx.post(srv.base_url + "/completions",
                         json={**body, "speculative": _draft(tmp_path / "nowhere")}, timeout=120)
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert spec["usage"]["speculative"]["accepted_tokens"] > 0
    assert bad.status_code == 400 and "speculative" in bad.text
