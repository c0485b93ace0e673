"""The default model against llama.cpp on the same GGUF (``parallm_bench.llamacpp_check``).

The comparison itself runs only where llama-cpp-python is importable, or ``PARALLM_LLAMA_CPP_PYTHON`` names
an interpreter that has it (it compiles llama.cpp; it is never a ParaLLM dependency). Its numbers are in
docs/default-model-check.md. The metrics are checked everywhere."""

from __future__ import annotations

import numpy as np
import pytest

from parallm_bench import llamacpp_check


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return (x - np.logaddexp.reduce(x)).astype(np.float32)


def test_metrics_of_identical_and_different_distributions():
    rng = np.random.default_rng(0)
    p = _log_softmax(rng.normal(0, 3, 1000))
    same = llamacpp_check.compare(p, p)
    assert same["top1_agree"] and same["top5_overlap"] == 1.0
    assert abs(same["kl_ref_eng"]) < 1e-6 and same["entropy_ref"] == pytest.approx(same["entropy_eng"])
    swapped = p.copy()
    top = np.argsort(-p)[:2]
    swapped[top[0]], swapped[top[1]] = p[top[1]], p[top[0]]  # the two most likely tokens trade places
    diff = llamacpp_check.compare(p, swapped)
    assert not diff["top1_agree"] and diff["top5_overlap"] == 1.0 and diff["kl_ref_eng"] > 0
    uniform = llamacpp_check.compare(p, _log_softmax(np.zeros(1000)))
    assert uniform["kl_ref_eng"] > diff["kl_ref_eng"]
    assert uniform["entropy_eng"] == pytest.approx(np.log(1000), rel=1e-5)


def _llamacpp_python():
    try:
        return llamacpp_check.llamacpp_python()
    except ModuleNotFoundError as exc:
        pytest.skip(f"llama.cpp is not available: {exc}")


@pytest.mark.slow
def test_default_model_matches_llama_cpp(engine):
    python = _llamacpp_python()
    res = llamacpp_check.run_check(python)
    assert res["prompts"] == 20
    assert res["template_matches_gguf"] and res["tokens_match_llama_cpp"] and res["engine_requests_match_forward"]
    # llama.cpp quantizes activations to 8 bits inside its Q4_1 matmuls; ParaLLM runs the dequantized
    # weights in float32. Measured: top-1 19/20 (the one miss a near-tie), top-5 0.98, KL mean 0.004.
    assert res["top1_agreement"] >= 0.9
    assert res["top5_overlap_mean"] >= 0.9
    assert res["kl_mean"] < 0.02 and res["kl_max"] < 0.1
