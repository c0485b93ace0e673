"""Shared fixtures: one engine on the real default model for the whole session, and tiny random models."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

# The suite compares float32 results exactly or to 1e-5; MLX's CUDA backend otherwise rounds float32 matmul
# inputs to TF32 (seen on an H100: batched != alone in the model zoo, 2e-4 in attention). No effect elsewhere.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# The prefix cache's disk tier is on by default: the suite's engines (and the servers it starts) keep it off,
# so a test's prefill counts never depend on what an earlier test left on disk. tests/test_kv_disk.py turns
# it on, in a directory of its own.
os.environ["PARALLM_KV_DISK"] = "0"

import parallm_engine  # noqa: E402,F401  (preloads BLAS before mlx)
from parallm_engine.kv.kv_pages import PagedLaneKV  # noqa: E402

# Every engine step in the suite checks the slot table it kept from the last step against a full build.
PagedLaneKV.VERIFY_TABLE = True


# The files that take longest (per-file times of a CI-class run), started first: `scripts/test` hands whole
# files to two workers in collection order, and a long file handed out last keeps one worker busy alone.
_LONG_FILES_FIRST = ("test_soak.py", "test_distributed.py", "integration_tests/", "test_model_zoo.py", "test_kv_quant.py",
                     "test_remote_without_mlx.py", "test_llama_index_remote.py", "test_clients.py", "test_vision.py",
                     "test_constrained.py", "test_engine.py", "test_speculative_draft.py", "test_server.py", "test_bf16.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        return next((i for i, name in enumerate(_LONG_FILES_FIRST) if name in item.nodeid), len(_LONG_FILES_FIRST))

    items.sort(key=rank)  # stable: a file's tests keep their order, other files theirs


@pytest.fixture(scope="session")
def engine():
    """The process-wide engine on the embedded default model (SmolLM2-135M-Instruct, fp32 on CPU)."""
    from parallm_engine import get_engine

    return get_engine()


def settled_stats(engine) -> dict:
    """``engine.stats()`` once the step that delivered the last tokens has ended: stats are the snapshot the
    engine thread publishes between steps, and a caller wakes on its last delta before that step retires
    the request (its KV into the prefix cache) and publishes."""
    engine.run_on_engine_thread(lambda: None)
    return engine.stats()


def chat_ids(engine, question: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return engine.apply_chat_template(msgs)


def write_tiny_llama(out: Path, **overrides) -> Path:
    """A random-weight llama (2 layers, 64 wide, 4 / 2 heads of 16 unless ``overrides`` say otherwise) with the
    default model's real tokenizer, written to ``out``: fast to run, real shapes of everything the engine
    touches, embeddings scaled up so logits are far from ties (greedy comparisons stay meaningful)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from .model_zoo import default_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    src, vocab_size = default_tokenizer()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    config = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "rope_theta": 10000.0, **overrides,
    }
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * 0.5
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random-weight llama using the default model's real tokenizer (:func:`write_tiny_llama`)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_32k_model_dir(tmp_path_factory) -> Path:
    """:func:`write_tiny_llama` with a 32,768-token context: a coding agent's prompts fit (its text is garbage)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-32k"), max_position_embeddings=32768)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    from parallm_engine import get_engine

    return get_engine(str(tiny_model_dir))
