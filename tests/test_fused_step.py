"""The step's prefill computed in the decode forward (``kv/fused_step.py``), and when it is not.

The model zoo checks every family with a prompt chunked beside decoding rows (greedy == mlx-lm) and
tests/test_kv_writes.py the bytes written and prompts joining the forward that prefills them; here: the
exact hidden-state / head split the fused step needs (``runner/logits_head.py``: found where it is exact,
refused where the family transforms its logits), and speculating rows beside fused prompts (a fused step
is a plain decode step), the answers unchanged.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
from parallm_engine import Engine
from parallm_engine.runner.logits_head import split_head

from .model_zoo import build, default_tokenizer, prompt_ids


@pytest.mark.parametrize("family, exact", [("llama", True), ("qwen3", True), ("granite", True), ("cohere", True),
                                           ("minicpm", True), ("gemma2", False)])
def test_split_head_is_exact_or_refused(family, exact, tmp_path):
    """llama / qwen3: ``head(backbone(x)) == model(x)`` bitwise; granite (logits divided by a scale), cohere
    (logits times a scale) and minicpm (the hidden state scaled before the head) with their scaling, also
    bitwise; gemma2 (a soft cap on the logits) has no exact split: None, and its steps are never fused."""
    from mlx_lm.utils import load

    tok_dir, vocab = default_tokenizer()
    model, _ = load(str(build(family, tmp_path / family, tok_dir, vocab)))
    split = split_head(model)
    assert (split is not None) == exact
    if split is not None:
        x = mx.array([prompt_ids(37, vocab, seed=3)])
        backbone, head = split
        assert mx.array_equal(head(backbone(x)), model(x)).item()


def test_speculating_rows_and_a_fused_prompt(tiny_model_dir):
    """A step whose forward computes prompt tokens is a plain decode step (no verify step: the prompts it
    finishes join its decode rows); speculation goes on in the other steps, and every answer equals the
    prompt alone."""
    eng = Engine(str(tiny_model_dir), speculative={"method": "ngram", "num_tokens": 4}, prefill_chunk=64,
                 prefill_budget=64, decode_lanes=1)
    try:
        vocab = eng.model_info.vocab_size
        loop = prompt_ids(8, vocab, seed=1) * 4  # repeats: the n-gram drafts find continuations
        late = [prompt_ids(260, vocab, seed=2), prompt_ids(30, vocab, seed=3)]
        alone = []
        for p in [loop, *late]:
            eng.clear_prefix_cache()
            alone.append(eng.generate([p], max_tokens=40, temperature=0, ignore_eos=True)[0].token_ids)
        eng.clear_prefix_cache()
        before = eng.stats()
        handle = eng.submit(loop, max_tokens=40, temperature=0, ignore_eos=True)
        stream = iter(handle)
        assert next(stream).token_ids
        others = [eng.submit(p, max_tokens=40, temperature=0, ignore_eos=True) for p in late]
        for _ in stream:
            pass
        assert [handle.request.result.token_ids] + [eng._collect(h).token_ids for h in others] == alone
        after = eng.stats()
        assert after["spec_steps"] > before["spec_steps"]
        assert after["fused_prefill_tokens"] - before["fused_prefill_tokens"] >= 128
    finally:
        eng.shutdown()


def test_fused_work_no_decode_step_took_runs_alone(tiny_model_dir):
    """Where the decode step takes no forward (its rows all ended when the step in flight was delivered),
    the step's fused work (a long prompt's chunk) runs alone, as in a lane that decodes nothing: the prompt's
    answer is unchanged."""
    eng = Engine(str(tiny_model_dir), speculative=None, prefill_chunk=64, prefill_budget=64, decode_lanes=1)
    try:
        vocab = eng.model_info.vocab_size
        short, long = prompt_ids(10, vocab, seed=1), prompt_ids(230, vocab, seed=2)
        alone = []
        for p in (short, long):
            eng.clear_prefix_cache()
            alone.append(eng.generate([p], max_tokens=20, temperature=0, ignore_eos=True)[0].token_ids)
        eng.clear_prefix_cache()
        runner = eng._scheduler.runner
        step, skipped = runner.step, []

        def step_without_forward(work=None):
            if work is not None and not skipped:  # as if every row ended at the flush: no forward
                skipped.append(work.n_tokens)
                return
            step(work)

        runner.step = step_without_forward
        handle = eng.submit(short, max_tokens=20, temperature=0, ignore_eos=True)
        stream = iter(handle)
        assert next(stream).token_ids
        late = eng.submit(long, max_tokens=20, temperature=0, ignore_eos=True)
        for _ in stream:
            pass
        assert [handle.request.result.token_ids, eng._collect(late).token_ids] == alone
        assert skipped, "no fused work met the skipped step"
    finally:
        eng.shutdown()
