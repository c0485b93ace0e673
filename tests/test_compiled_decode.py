"""The plain decode step as one compiled graph (``runner/compiled_decode.py``, ``Engine(compile_decode=True)`` or
``PARALLM_COMPILE_DECODE=1``).

On the pure-MLX path (the one Metal and CUDA run), for every family whose layers are full attention: greedy
answers of a batch of prompts of different lengths, with rows leaving at different steps and one joining
late, equal mlx-lm's own generation of each prompt alone, and most decode steps ran compiled with few traces.
A model whose attention never asks the cache for its mask is refused and runs eagerly, still correct.
"""

from __future__ import annotations

import pytest

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
from parallm_engine import Engine
from parallm_engine.runner import compiled_decode

from .conftest import settled_stats
from .model_zoo import FAMILIES, build, default_tokenizer, prompt_ids, reference_greedy

# Families whose cache is full attention in every layer (the paged decode batch the compiled step is for).
ATTENTION_FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2", "phi3", "granite", "olmo2",
                      "deepseek_v3", "deepseek_v2", "minicpm", "cohere"]


def _run(model_dir, prompts, max_tokens, late=None, **kw):
    """Greedy answers of ``prompts`` submitted at once (and ``late``, submitted once the first has streamed
    tokens), with the engine's stats after."""
    eng = Engine(str(model_dir), backend="cpu-mlx", decode_lanes=1, speculative=None, **kw)
    try:
        handles = [eng.submit(p, max_tokens=n, temperature=0, ignore_eos=True) for p, n in zip(prompts, max_tokens)]
        late_handle = None
        if late is not None:
            stream = iter(handles[0])
            for _ in range(6):
                next(stream)
            late_handle = eng.submit(late[0], max_tokens=late[1], temperature=0, ignore_eos=True)
        answers = [eng._collect(h).token_ids for h in handles]
        if late_handle is not None:
            answers.append(eng._collect(late_handle).token_ids)
        return answers, settled_stats(eng), eng
    finally:
        eng.shutdown()


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_compiled_steps_equal_mlx_lm(family, tmp_path, monkeypatch):
    from mlx_lm.utils import load

    assert family in FAMILIES
    tok_dir, vocab = default_tokenizer()
    path = build(family, tmp_path / family, tok_dir, vocab)
    prompts = [prompt_ids(n, vocab, seed=s) for s, n in enumerate((5, 23, 40, 11))]
    max_tokens = [48, 30, 48, 16]  # rows leave at different steps
    late = (prompt_ids(17, vocab, seed=9), 24)
    model, _ = load(str(path))
    expected = [reference_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]
    expected.append(reference_greedy(model, late[0], late[1]))
    monkeypatch.setenv("PARALLM_COMPILE_DECODE", "1")
    answers, stats, eng = _run(path, prompts, max_tokens, late)
    assert eng._scheduler.kv.layout == "attention"
    assert answers == expected
    assert stats["memory"]["decode_compiled_steps"] >= 20, stats
    assert 1 <= stats["memory"]["decode_compile_traces"] <= stats["memory"]["decode_compiled_steps"] // 2


def test_off_by_default_and_counted(tiny_model_dir, monkeypatch):
    """Without the variable no step is compiled; with it the same answers, most steps compiled."""
    monkeypatch.delenv("PARALLM_COMPILE_DECODE", raising=False)
    vocab = 49152
    prompts = [prompt_ids(n, vocab, seed=s) for s, n in enumerate((9, 31, 70))]
    eager, stats_eager, _ = _run(tiny_model_dir, prompts, [60, 60, 60])
    assert stats_eager["memory"]["decode_compiled_steps"] == 0
    monkeypatch.setenv("PARALLM_COMPILE_DECODE", "1")
    compiled, stats, _ = _run(tiny_model_dir, prompts, [60, 60, 60])
    assert compiled == eager
    # the Engine option, without the variable (an explicit option wins over the variable both ways)
    monkeypatch.setenv("PARALLM_COMPILE_DECODE", "0")
    by_option, stats_option, _ = _run(tiny_model_dir, prompts, [60, 60, 60], compile_decode=True)
    assert by_option == eager and stats_option["memory"]["decode_compiled_steps"] >= 50
    assert stats["memory"]["decode_compiled_steps"] >= 50
    # the kept arrays are rebuilt every ROOM steps at most: a trace per capacity, not per step
    assert stats["memory"]["decode_compile_traces"] <= 2


def test_a_model_that_ignores_the_cache_mask_is_refused(tiny_model_dir, monkeypatch):
    """A forward that never calls the cache's ``make_mask`` for a decode step (a family computing its own mask,
    None for one token) would attend over the kept arrays' unwritten columns: the trace refuses it
    (``NotCompilable``) and that lane's steps run eagerly from then on, the answers unchanged."""
    from mlx_lm.utils import load

    model, _ = load(str(tiny_model_dir))
    prompts = [prompt_ids(n, 49152, seed=s) for s, n in enumerate((9, 31))]
    expected = [reference_greedy(model, p, 20) for p in prompts]
    monkeypatch.setenv("PARALLM_COMPILE_DECODE", "1")
    eng = Engine(str(tiny_model_dir), backend="cpu-mlx", decode_lanes=1, speculative=None)
    try:
        inner = eng.model.model
        original = type(inner).__call__

        class OwnMask(type(inner)):  # this instance only: the traced step's caches hand out no mask
            def __call__(self, inputs, cache=None, *args, **kw):
                for c in cache or ():
                    if isinstance(c, compiled_decode._TracedLayerKV):
                        c.make_mask = lambda *a, **k: None
                return original(self, inputs, cache, *args, **kw)

        inner.__class__ = OwnMask
        answers = [r.token_ids for r in eng.generate(prompts, max_tokens=20, temperature=0, ignore_eos=True)]
        assert settled_stats(eng)["memory"]["decode_compiled_steps"] == 0
        assert all(c.refused for c in eng._scheduler.runner.forwards.compiled)
    finally:
        eng.shutdown()
    assert answers == expected
