"""Speculative decoding (n-gram prompt lookup) inside the continuous batch: exactness, rollback, limits,
statistics, typed errors. Tiny models except one check on the default model."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest

from parallm_engine import Engine
from parallm_engine.errors import InvalidRequestError
from parallm_engine.kv.kv_pages import PagedLaneKV
from parallm_engine.sampling.sampling_params import SamplingParams
from parallm_engine.sampling.spec_config import OFF, SpeculativeConfig, parse_speculative
from parallm_engine.spec.speculative import NgramIndex

# Not adaptive: these tests need every step to speculate, whatever this machine's step costs say (the
# adaptive width is tested with given costs in test_spec_policy.py).
NGRAM = {"method": "ngram", "num_tokens": 4, "adaptive": False}
JSON_BLOCK = json.dumps({"name": "parallm", "version": "1.2.3", "deps": {"mlx": ">=0.20", "numpy": ">=1.26"},
                         "scripts": {"serve": "parallm serve", "bench": "parallm bench"}})


def _loop_prompt(engine, n: int = 60, seed: int = 0) -> list[int]:
    """A prompt that repeats itself (so prompt lookup has something to propose)."""
    import random

    rng = random.Random(seed)
    base = [rng.randrange(300, 5000) for _ in range(12)]
    return (base * (n // len(base) + 1))[:n]


@pytest.fixture(scope="module")
def small_vocab_engine(tmp_path_factory, engine):
    """A 2-layer random llama with a 32-token vocabulary (the default model's tokenizer, ids below 32 only)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    import shutil

    out = tmp_path_factory.mktemp("vocab32")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (engine.model_info.path / name).exists():
            shutil.copy(engine.model_info.path / name, out / name)
    config = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-5,
              "vocab_size": 32, "max_position_embeddings": 256, "tie_word_embeddings": True, "rope_theta": 10000.0}
    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * 0.2
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    eng = Engine(str(out), max_batch_size=128)
    yield eng
    eng.shutdown()


# -- settings ------------------------------------------------------------------------------------
def test_settings_parse_and_bad_values_are_typed_errors():
    assert parse_speculative(None) is None
    assert parse_speculative(False) is OFF and not OFF.enabled
    assert parse_speculative("ngram") == SpeculativeConfig()
    cfg = parse_speculative({"method": "ngram", "num_tokens": 6, "min_match": 3})
    assert (cfg.num_tokens, cfg.min_match, cfg.max_match) == (6, 3, 4)
    for bad in ({"method": "medusa"}, {"num_tokens": 0}, {"num_tokens": 99}, {"num_tokens": 2.5},
                {"min_match": 5, "max_match": 2}, {"nope": 1}, {"method": "draft", "model": "/x"}, 42,
                {"adaptive": "yes"}):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams.from_kwargs(speculative=bad)
        assert info.value.param == "speculative"


def test_ngram_index_proposes_the_latest_continuation():
    idx = NgramIndex(2, 3)
    ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    assert idx.propose(ctx, 2) == [5, 6]  # the latest earlier "1 2 3" was followed by 5 6
    assert idx.propose(ctx + [5], 4) == [6, 1, 2, 3]
    assert idx.propose([7, 8], 3) == []


def test_rollback_forgets_the_last_positions_exactly():
    mx.random.seed(0)
    B, H, D = 3, 2, 4
    rows = [(mx.random.normal((1, H, L, D)), mx.random.normal((1, H, L, D))) for L in (5, 3, 7)]
    kv = PagedLaneKV(1)
    kv.add([rows])
    layer = kv.layers[0]
    new_k, new_v = mx.random.normal((B, H, 4, D)), mx.random.normal((B, H, 4, D))
    kv.begin(4)
    layer.update_and_fetch(new_k, new_v)
    kv.rollback_rows(4, [2, 2, 2])
    for i, (k, v) in enumerate(rows):
        got_k, got_v = kv.row(i, 0, k.shape[2] + 2)[0]
        assert mx.array_equal(got_k, mx.concatenate([k, new_k[i : i + 1, :, :2]], axis=2))
        assert mx.array_equal(got_v, mx.concatenate([v, new_v[i : i + 1, :, :2]], axis=2))
    assert kv.positions() == [5 + 2, 3 + 2, 7 + 2]
    # The next write lands where the forgotten positions were.
    kv.begin(1)
    layer.update_and_fetch(new_k[:, :, 3:], new_v[:, :, 3:])
    assert mx.array_equal(kv.row(1, 0, 6)[0][0][:, :, 5:], new_k[1:2, :, 3:])


# -- exactness -----------------------------------------------------------------------------------
def test_greedy_equals_plain_greedy_on_the_default_model(engine):
    prompt = engine.apply_chat_template(
        [{"role": "user", "content": "Repeat this JSON exactly, changing the version to 2.0.0:\n" + JSON_BLOCK}])
    before = engine.stats()["spec_accepted_tokens"]
    plain = engine.generate(prompt, max_tokens=48, temperature=0)[0]
    spec = engine.generate(prompt, max_tokens=48, temperature=0, speculative=NGRAM)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.usage.spec_accepted_tokens > 10  # a copy: most drafts are accepted
    assert spec.usage.as_dict()["speculative"]["proposed_tokens"] == spec.usage.spec_proposed_tokens
    assert engine.stats()["spec_accepted_tokens"] - before == spec.usage.spec_accepted_tokens


def test_grammar_constrained_greedy_equals_plain(engine):
    """Drafts the grammar forbids are cut; verified positions are masked with the grammar's state."""
    prompt = engine.apply_chat_template(
        [{"role": "user", "content": "Repeat this JSON exactly:\n" + JSON_BLOCK}])
    fmt = {"type": "json_object"}
    plain = engine.generate(prompt, max_tokens=40, temperature=0, response_format=fmt)[0]
    spec = engine.generate(prompt, max_tokens=40, temperature=0, response_format=fmt, speculative=NGRAM)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.usage.spec_accepted_tokens > 5


def test_greedy_alone_and_in_a_mixed_batch(tiny_engine):
    prompts = [_loop_prompt(tiny_engine, 60, seed) for seed in range(4)]
    plain = [r.token_ids for r in tiny_engine.generate(prompts, max_tokens=40, temperature=0)]
    alone = tiny_engine.generate(prompts[0], max_tokens=40, temperature=0, speculative=NGRAM)[0]
    assert alone.token_ids == plain[0]
    assert alone.usage.spec_proposed_tokens > 0
    # Rows with and without speculation (and with different k) in one batch.
    handles = [tiny_engine.submit(p, max_tokens=40, temperature=0,
                                  speculative=[NGRAM, None, {"num_tokens": 2}, False][i])
               for i, p in enumerate(prompts)]
    mixed = [Engine._collect(h).token_ids for h in handles]
    assert mixed == plain


def test_seeded_sampling_is_the_same_tokens_with_and_without_speculation(tiny_engine):
    prompts = [_loop_prompt(tiny_engine, 48, seed) for seed in range(3)]
    kw = dict(max_tokens=32, temperature=0.7, top_p=0.95)
    plain = [tiny_engine.generate(p, seed=11 + i, **kw)[0].token_ids for i, p in enumerate(prompts)]
    handles = [tiny_engine.submit(p, seed=11 + i, speculative=NGRAM, **kw) for i, p in enumerate(prompts)]
    assert [Engine._collect(h).token_ids for h in handles] == plain


def test_max_tokens_stop_strings_and_logprobs(tiny_engine):
    prompt = _loop_prompt(tiny_engine, 60, 1)
    for n in (1, 2, 5, 7):
        r = tiny_engine.generate(prompt, max_tokens=n, temperature=0, speculative=NGRAM)[0]
        assert len(r.token_ids) == n and r.finish_reason == "length"
    plain = tiny_engine.generate(prompt, max_tokens=30, temperature=0, logprobs=True, top_logprobs=2)[0]
    stop = tiny_engine.decode(plain.token_ids[10:12])
    spec = tiny_engine.generate(prompt, max_tokens=30, temperature=0, logprobs=True, top_logprobs=2,
                                speculative=NGRAM)[0]
    assert spec.token_ids == plain.token_ids
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
        assert [t for t, _, _ in a.top_logprobs] == [t for t, _, _ in b.top_logprobs]
    cut_plain = tiny_engine.generate(prompt, max_tokens=30, temperature=0, stop=[stop])[0]
    cut_spec = tiny_engine.generate(prompt, max_tokens=30, temperature=0, stop=[stop], speculative=NGRAM)[0]
    assert cut_spec.text == cut_plain.text and cut_spec.finish_reason == "stop"
    assert stop not in cut_spec.text


def test_rollback_leaves_the_prefix_cache_holding_only_accepted_tokens(tiny_model_dir):
    spec_engine = Engine(str(tiny_model_dir))
    cold_engine = Engine(str(tiny_model_dir), enable_prefix_cache=False)
    try:
        prompt = _loop_prompt(spec_engine, 50, 2)
        first = spec_engine.generate(prompt, max_tokens=30, temperature=0, speculative=NGRAM)[0]
        assert first.usage.spec_proposed_tokens > first.usage.spec_accepted_tokens  # some were rejected
        context = prompt + first.token_ids
        stored = spec_engine.run_on_engine_thread(lambda: _tree_paths(spec_engine._scheduler.radix.root))
        assert stored and all(context[: len(p)] == p for p in stored)
        follow = context + [77, 78]
        hit = spec_engine.generate(follow, max_tokens=16, temperature=0)[0]
        assert hit.usage.cached_tokens >= len(context) - 1
        cold = cold_engine.generate(follow, max_tokens=16, temperature=0)[0]
        assert hit.token_ids == cold.token_ids
    finally:
        spec_engine.shutdown()
        cold_engine.shutdown()


def _tree_paths(node, prefix=()) -> list[list[int]]:
    path = prefix + tuple(node.tokens)
    kids = list(node.children.values())
    if not kids:
        return [list(path)] if path else []
    return [p for child in kids for p in _tree_paths(child, path)]


def test_engine_default_and_request_opt_out(tiny_model_dir):
    eng = Engine(str(tiny_model_dir), speculative={"method": "ngram", "num_tokens": 3, "adaptive": False})
    try:
        prompt = _loop_prompt(eng, 48, 3)
        on = eng.generate(prompt, max_tokens=24, temperature=0)[0]
        off = eng.generate(prompt, max_tokens=24, temperature=0, speculative=False)[0]
        assert on.token_ids == off.token_ids
        assert on.usage.spec_proposed_tokens > 0 and off.usage.spec_proposed_tokens == 0
        # Penalties do not speculate under the default; asked for explicitly, they are refused.
        assert eng.generate(prompt, max_tokens=8, repetition_penalty=1.2)[0].usage.spec_proposed_tokens == 0
        with pytest.raises(InvalidRequestError):
            eng.submit(prompt, max_tokens=8, repetition_penalty=1.2, speculative=NGRAM)
    finally:
        eng.shutdown()


def test_mixed_layout_models_refuse_speculation(tmp_path):
    from tests.model_zoo import build, default_tokenizer

    tok_dir, vocab = default_tokenizer()
    path = build("gemma3_text", tmp_path / "g3", tok_dir, vocab)
    with pytest.raises(InvalidRequestError, match="rolled back"):
        Engine(str(path), speculative=NGRAM)
    eng = Engine(str(path))
    try:
        with pytest.raises(InvalidRequestError) as info:
            eng.submit([5, 6, 7], max_tokens=4, speculative=NGRAM)
        assert info.value.param == "speculative"
        assert len(eng.generate([5, 6, 7], max_tokens=4, temperature=0)[0].token_ids) == 4
    finally:
        eng.shutdown()


# -- distribution ----------------------------------------------------------------------------------
def _chi_square_p(observed: list[int], expected: list[float]) -> float:
    """Pearson's test, bins with expected count < 5 merged; the upper-tail p-value."""
    from scipy.stats import chi2

    obs, exp, o_acc, e_acc = [], [], 0, 0.0
    for o, e in sorted(zip(observed, expected), key=lambda x: -x[1]):
        o_acc, e_acc = o_acc + o, e_acc + e
        if e_acc >= 5:
            obs.append(o_acc)
            exp.append(e_acc)
            o_acc, e_acc = 0, 0.0
    if e_acc:
        obs[-1] += o_acc
        exp[-1] += e_acc
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return float(chi2.sf(stat, max(1, len(obs) - 1)))


def test_sampled_speculative_output_follows_the_target_distribution(small_vocab_engine):
    """The second generated token's distribution (the first one that can come from an accepted draft or
    a residual draw) against the exact target marginal sum_a p(a) p(b | a), at temperature 0.8."""
    eng = small_vocab_engine
    model = eng.model
    seq = [5, 9]
    for _ in range(6):
        seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1])))
    prompt = seq + seq[:2]  # the lookup proposes the model's own likely continuation (p ~ 0.4 each)
    T = 0.8
    logits = model(mx.array([prompt]))[0, -1] / T
    p1 = mx.softmax(logits).tolist()
    nxt = model(mx.array([prompt + [a] for a in range(32)]))[:, -1] / T
    p2_given = mx.softmax(nxt, axis=-1)
    marginal = (mx.array(p1)[:, None] * p2_given).sum(axis=0).tolist()
    counts = [0] * 32
    n_samples, accepted = 0, 0
    # One request at a time: each sample is one row's accepted chain, verified alone.
    for i in range(600):
        res = eng.generate(prompt, max_tokens=3, temperature=T, ignore_eos=True, seed=1000 + i,
                           speculative={"method": "ngram", "num_tokens": 3, "adaptive": False})[0]
        accepted += res.usage.spec_accepted_tokens
        counts[res.token_ids[1]] += 1
        n_samples += 1
    assert accepted > 50  # drafts were accepted often enough for the test to mean something
    # The test has power: the first token's distribution (a wrong answer here) is rejected.
    assert _chi_square_p(counts, [q * n_samples for q in p1]) < 1e-6
    assert _chi_square_p(counts, [m * n_samples for m in marginal]) > 1e-3


# -- integrations and server ---------------------------------------------------------------------
def test_integrations_validate_and_pass_speculative(tiny_model_dir):
    from parallm_integrations import ChatParaLLM
    from parallm_integrations.llama_index import ParaLLMLlamaIndex

    with pytest.raises(ValueError, match="speculative"):
        ChatParaLLM(model=str(tiny_model_dir), speculative={"method": "medusa"})
    with pytest.raises(ValueError, match="speculative"):
        ParaLLMLlamaIndex(model=str(tiny_model_dir), speculative={"num_tokens": 100})
    llm = ChatParaLLM(model=str(tiny_model_dir), temperature=0, max_tokens=24, speculative=NGRAM)
    assert llm._identifying_params["speculative"] == NGRAM
    assert llm._build_request(None, {}).sampling["speculative"] == NGRAM
    li = ParaLLMLlamaIndex(model=str(tiny_model_dir), temperature=0, max_tokens=8, speculative="ngram")
    assert li._build_request({}).sampling["speculative"] == "ngram"


def test_server_speculative_field_and_usage_extension(engine):
    import httpx

    from parallm_engine.serve.server import ServerThread

    body = {"model": "default", "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "Repeat exactly:\n" + JSON_BLOCK}]}
    with ServerThread(engine=engine) as srv:
        plain = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=120).json()
        spec = httpx.post(srv.base_url + "/chat/completions", json={**body, "speculative": NGRAM}, timeout=120)
        bad = httpx.post(srv.base_url + "/chat/completions", json={**body, "speculative": {"method": "x"}}, timeout=120)
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    spec = spec.json()
    assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert spec["usage"]["speculative"]["proposed_tokens"] > 0 and "speculative" not in plain["usage"]
    assert bad.status_code == 400 and "speculative" in bad.text
    assert "spec_accepted_tokens_total" in metrics


@pytest.mark.parametrize("kernels", [False, True], ids=["mlx-ops", "cpu-kernels"])
def test_a_ragged_step_computes_what_the_rectangle_does(kernels):
    """Verification runs each row over only its own positions (``BatchForward.forward_ragged``: one model
    row per position, the attention laid out as the rows' rectangle): its logits are the padded
    rectangle's at every real position, on the MLX-ops attention (Metal, CUDA) and the CPU kernels."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    from parallm_engine.runner import cpu_kernels

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
              "vocab_size": 128, "max_position_embeddings": 512, "tie_word_embeddings": True, "rope_theta": 10000.0}
    mx.random.seed(7)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    assert cpu_kernels.install(model, 512, kernels=kernels)
    nat = cpu_kernels.native_module() if kernels else None
    kv = PagedLaneKV(2)
    per_layer = [[], []]
    for L in (7, 3, 12):
        cache = make_prompt_cache(model)
        model(mx.random.randint(0, 128, (1, L)), cache=cache)
        for layer, c in zip(per_layer, cache):
            layer.append((c.keys[..., :L, :], c.values[..., :L, :]))
    kv.add(per_layer)
    rows = [[5, 9, 17], [33], [2, 40]]
    W = 3
    with cpu_kernels.enabled(kernels):
        kv.begin(W, nat, nat is not None)
        rect = model(mx.array([r + [r[-1]] * (W - len(r)) for r in rows]), cache=kv.layers)
        mx.eval(rect)
        kv.rollback_rows(W, [0, 0, 0])
        kv.begin([len(r) for r in rows], nat, nat is not None)
        ragged = model(mx.array([t for r in rows for t in r])[:, None], cache=kv.layers)[:, 0]
        mx.eval(ragged)
        kv.rollback_rows([len(r) for r in rows], [len(r) for r in rows])
    want = mx.stack([rect[i, j] for i, r in enumerate(rows) for j in range(len(r))])
    assert mx.allclose(ragged, want, atol=1e-4, rtol=1e-4).item()
    assert kv.positions() == [10, 4, 14] and kv.layers[0].ragged is None
