"""Models by name (``parallm_engine.models.hub``) against a real HTTP server that speaks the hub's file API
(``tests/hub_server.py``), not a mock of huggingface_hub. Each download runs in a fresh Python process with
its own ``HF_HOME`` and ``HF_ENDPOINT`` (huggingface_hub reads some of its settings once, at import)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hub_server import LocalHub

ROOT = Path(__file__).resolve().parents[1]
FAILED = "FAILED "  # what the child prints before an exception's class name and message


@pytest.fixture(scope="module")
def default_model_dir() -> Path:
    """The embedded default model as an HF/MLX directory (its GGUF converted once, cached)."""
    from parallm_engine.models.gguf import ensure_converted
    from parallm_engine.models.loader import default_model_path

    return ensure_converted(default_model_path())


@pytest.fixture(scope="module")
def tiny_repo_dir(tmp_path_factory, default_model_dir) -> Path:
    """A 2-layer random-weight llama with the default model's tokenizer: a repo that downloads in no time."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    out = tmp_path_factory.mktemp("tiny-repo")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_dir / name, out / name)
    vocab = json.loads((default_model_dir / "config.json").read_text())["vocab_size"]
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": vocab,
              "max_position_embeddings": 512, "tie_word_embeddings": True, "rope_theta": 10000.0}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def run_child(code: str, hf_home: Path, endpoint: str | None, **env) -> tuple[dict, float]:
    """Run ``code`` in a fresh interpreter with this HF_HOME / HF_ENDPOINT; it prints one JSON line last.
    Returns (that JSON, seconds the child took)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    child_env.update(HF_HOME=str(hf_home), PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'engine'}",
                     HF_HUB_DISABLE_TELEMETRY="1", **env)
    if endpoint:
        child_env["HF_ENDPOINT"] = endpoint
    wrapped = (
        "import json, sys\n"
        "def report(**kw): print(json.dumps(kw), flush=True)\n"
        "try:\n" + "".join(f"    {line}\n" for line in code.strip().splitlines()) +
        "except Exception as exc:\n"
        "    report(error=type(exc).__name__, message=str(exc),"
        " mro=[c.__name__ for c in type(exc).__mro__])\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", wrapped], env=child_env, capture_output=True, text=True,
                          timeout=300)
    took = time.monotonic() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1]), took


FETCH = "from parallm_engine.models.hub import fetch_model\nreport(path=str(fetch_model({spec!r})))"

ASK_PARIS = """
from parallm_engine import get_engine
eng = get_engine({spec!r})
ids = eng.apply_chat_template([{{"role": "user", "content": "What is the capital of France?"}}])
out = eng.generate([ids], max_tokens=24, temperature=0.0)[0]
import os
report(text=out.text, name=eng.model_info.name, path=str(eng.model_info.path),
       files=sorted(os.listdir(eng.model_info.path)))
"""


def test_allow_patterns_are_mlx_lms():
    """The same patterns as mlx-lm's download: what mlx-lm downloaded opens here offline and back."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    from parallm_engine.models.hub import TEXT_ALLOW_PATTERNS

    assert TEXT_ALLOW_PATTERNS == DEFAULT_ALLOW_PATTERNS


def test_parse_repo_spec(tmp_path):
    from parallm_engine.models.hub import parse_repo_spec

    assert parse_repo_spec("mlx-community/Qwen3-4B-Instruct-2507-4bit") == (
        "mlx-community/Qwen3-4B-Instruct-2507-4bit", None)
    assert parse_repo_spec("org/name@v1.0") == ("org/name", "v1.0")
    for not_an_id in ("name", "org/name@", "./org/name", "/abs/path", "a/b/c", "org/../x", None):
        assert parse_repo_spec(not_an_id) is None, not_an_id
    (tmp_path / "org" / "name").mkdir(parents=True)
    os.chdir(tmp_path)
    try:
        assert parse_repo_spec("org/name") is None  # an existing directory is a path, not a repo id
    finally:
        os.chdir(ROOT)


def test_download_answers_then_works_offline(tmp_path, default_model_dir):
    """The default model's files as a hub repo: the first run downloads only the files a model needs and
    answers; with the server gone and HF_HUB_OFFLINE=1 the second run answers from the cache."""
    repo = _copy(default_model_dir, tmp_path / "repo")
    spec = "parallm-test/SmolLM2-135M-Instruct"
    with LocalHub() as hub:
        hub.add_repo(spec, repo, extra={"README.md": b"# card\n", "pytorch_model.bin": b"\0" * 4096})
        online, _ = run_child(ASK_PARIS.format(spec=spec), tmp_path / "hf", hub.url)
        asked = [path for _, path in hub.requests]
    assert "error" not in online, online
    assert "Paris" in online["text"], online["text"]
    assert online["name"] == spec
    assert Path(online["path"]).is_relative_to(tmp_path / "hf" / "hub")  # the user's hub cache (HF_HOME)
    assert "README.md" not in online["files"] and "pytorch_model.bin" not in online["files"]
    assert not any(p.endswith(("pytorch_model.bin", "README.md")) for p in asked)
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(online["files"])

    offline, _ = run_child(ASK_PARIS.format(spec=spec), tmp_path / "hf", None, HF_HUB_OFFLINE="1")
    assert "error" not in offline, offline
    assert offline["text"] == online["text"] and offline["path"] == online["path"]
    # The hub gone but HF_HUB_OFFLINE unset (a laptop on a train): the cache answers too.
    unreachable, _ = run_child(FETCH.format(spec=spec), tmp_path / "hf", "http://127.0.0.1:9")
    assert unreachable == {"path": online["path"]}


def test_unknown_repo_fails_fast_with_typed_error(tmp_path, tiny_repo_dir):
    with LocalHub() as hub:
        hub.add_repo("parallm-test/tiny", tiny_repo_dir)
        missing, took = run_child(FETCH.format(spec="nobody/no-such-model"), tmp_path / "hf", hub.url)
        bad_rev, _ = run_child(FETCH.format(spec="parallm-test/tiny@no-such-branch"), tmp_path / "hf", hub.url)
        ok_rev, _ = run_child(FETCH.format(spec=f"parallm-test/tiny@{hub.repos['parallm-test/tiny'].sha}"),
                              tmp_path / "hf", hub.url)
    print(f"unknown repo: typed error after {took:.1f}s (child process start included)")
    assert missing["error"] == "ModelNotFoundError" and "ModelLoadError" in missing["mro"]
    assert "nobody/no-such-model" in missing["message"]
    assert bad_rev["error"] == "ModelNotFoundError" and "revision" in bad_rev["message"]
    assert Path(ok_rev["path"]).name == hub.repos["parallm-test/tiny"].sha


def test_offline_and_not_cached(tmp_path):
    out, _ = run_child(FETCH.format(spec="parallm-test/never-downloaded"), tmp_path / "hf", None,
                       HF_HUB_OFFLINE="1")
    assert out["error"] == "ModelNotCachedError" and "HF_HUB_OFFLINE" in out["message"]
    assert "parallm pull parallm-test/never-downloaded" in out["message"]


def test_gated_repo_needs_a_token(tmp_path, tiny_repo_dir):
    with LocalHub() as hub:
        hub.add_repo("parallm-test/gated", tiny_repo_dir, gated_token="hf_test_token")
        refused, _ = run_child(FETCH.format(spec="parallm-test/gated"), tmp_path / "hf", hub.url)
        allowed, _ = run_child(FETCH.format(spec="parallm-test/gated"), tmp_path / "hf", hub.url,
                               HF_TOKEN="hf_test_token")
    assert refused["error"] == "GatedModelError" and "HF_TOKEN" in refused["message"]
    assert "error" not in allowed and (Path(allowed["path"]) / "model.safetensors").is_file()


def test_architecture_nobody_runs_is_refused_before_weights_move(tmp_path, tiny_repo_dir):
    repo = _copy(tiny_repo_dir, tmp_path / "repo")
    config = json.loads((repo / "config.json").read_text())
    (repo / "config.json").write_text(json.dumps({**config, "model_type": "quantum_llm",
                                                  "architectures": ["QuantumLLMForCausalLM"]}))
    with LocalHub() as hub:
        hub.add_repo("parallm-test/quantum", repo)
        out, _ = run_child(FETCH.format(spec="parallm-test/quantum"), tmp_path / "hf", hub.url)
        asked = [path for _, path in hub.requests]
    assert out["error"] == "UnsupportedArchitectureError" and "UnsupportedModelError" in out["mro"]
    assert "quantum_llm" in out["message"] and "QuantumLLMForCausalLM" in out["message"]
    assert not any(p.endswith("model.safetensors") for p in asked)


def test_interrupted_download_is_never_loaded_and_resumes(tmp_path, tiny_repo_dir):
    """The server drops the connection in the middle of the weights every time: the download fails with
    the typed error, the cache hands nothing partial to the loader (offline: still refused), and once the
    server behaves the same call resumes and the model runs."""
    spec = "parallm-test/flaky"
    load = "from parallm_engine import get_engine\neng = get_engine({spec!r})\n" \
           "report(text=eng.generate(['Hello'], max_tokens=4, temperature=0.0)[0].text)"
    with LocalHub() as hub:
        hub.add_repo(spec, tiny_repo_dir)
        size = hub.repos[spec].files["model.safetensors"].size
        hub.drop_after[(spec, "model.safetensors")] = size // 3
        cut, _ = run_child(load.format(spec=spec), tmp_path / "hf", hub.url)
        assert cut["error"] == "ModelDownloadError", cut
        assert "again" in cut["message"]
        cache = tmp_path / "hf" / "hub" / "models--parallm-test--flaky"
        weights_blob = cache / "blobs" / hub.repos[spec].files["model.safetensors"].sha256
        assert not weights_blob.exists() and not list(cache.rglob("model.safetensors"))
        assert list(cache.rglob("config.json"))  # the files that did arrive whole are kept

        offline, _ = run_child(load.format(spec=spec), tmp_path / "hf", None, HF_HUB_OFFLINE="1")
        assert offline["error"] == "ModelDownloadError" and "incomplete" in offline["message"], offline

        hub.drop_after.clear()
        hub.requests.clear()
        again, _ = run_child(load.format(spec=spec), tmp_path / "hf", hub.url)
        resumed = [p for m, p in hub.requests if m == "GET" and p.endswith("model.safetensors")]
    assert "error" not in again and isinstance(again["text"], str), again
    assert resumed and weights_blob.stat().st_size == size
    assert not list(cache.rglob("*.incomplete"))


ENCODER_BY_ID = """
from parallm_engine import get_embedding_engine, get_engine
from parallm_engine.errors import UnsupportedArchitectureError
by_id = get_embedding_engine({spec!r})
local = get_embedding_engine({local!r})
a, b = by_id.embed(["hello world", "a second text"]), local.embed(["hello world", "a second text"])
try:
    get_engine({spec!r})
    chat = "loaded"
except UnsupportedArchitectureError as exc:
    chat = str(exc)
report(kind=type(by_id).__name__, path=str(by_id.model_info.path), diff=max(abs(x - y) for u, v in zip(a, b)
       for x, y in zip(u, v)), chat=chat)
"""


def test_encoder_embedding_model_by_hub_id_downloads_on_first_use(tmp_path):
    """A BERT-family embedder named by hub id downloads into the hub cache on first use (as chat models do) and
    embeds as its local copy does; the chat engine refuses it, saying what runs it."""
    pytest.importorskip("mlx_embeddings")
    from tests.embedding_models import build_bert_encoder

    local = build_bert_encoder(tmp_path / "bert-local")
    spec = "parallm-test/bert-tiny"
    with LocalHub() as hub:
        hub.add_repo(spec, _copy(local, tmp_path / "bert-repo"), extra={"pytorch_model.bin": b"\0" * 4096})
        got, _ = run_child(ENCODER_BY_ID.format(spec=spec, local=str(local)), tmp_path / "hf", hub.url)
        asked = [path for _, path in hub.requests]
    assert "error" not in got, got
    assert got["kind"] == "EncoderEngine" and Path(got["path"]).is_relative_to(tmp_path / "hf" / "hub")
    assert got["diff"] < 1e-6
    assert "encoder embedding model" in got["chat"] and "get_embedding_engine" in got["chat"]
    assert not any(p.endswith("pytorch_model.bin") for p in asked)


ADAPTER_BY_ID = """
from parallm_engine import Engine
from parallm_engine.errors import AdapterNotFoundError
ids = list(range(40, 70))
by_id = Engine({spec!r}, adapters={{"a": {adapter!r}}})
def run(eng, **kw):  # tokens and their logprobs (a random tiny model may repeat one token either way)
    r = eng.generate([ids], max_tokens=8, temperature=0, logprobs=True, **kw)[0]
    return [r.token_ids, [round(lp.logprob, 4) for lp in r.logprobs]]
got = run(by_id, adapter="a")
local = Engine({local!r}, adapters={{"a": {local_adapter!r}}})
want, base = run(local, adapter="a"), run(local)
try:
    Engine({spec!r}, adapters={{"b": "nobody/no-such-adapter"}})
    missing = "loaded"
except AdapterNotFoundError as exc:
    missing = str(exc)
try:  # a request naming an id not in the cache: refused, never downloaded by a request
    by_id.generate([ids], max_tokens=2, adapter="parallm-test/other-lora")
    by_request = "loaded"
except AdapterNotFoundError as exc:
    by_request = str(exc)
report(got=got, want=want, base=base, missing=missing, by_request=by_request)
"""


def test_lora_adapter_by_hub_id_downloads_on_first_use(tmp_path, tiny_repo_dir):
    """An adapter named by hub id when the engine starts downloads on first use (its config and weights only)
    and gives the tokens its local copy gives; an unknown id is a typed error; a request cannot make the
    engine download one."""
    from parallm_bench.lora import write_random_adapter

    adapter = write_random_adapter(tiny_repo_dir, tmp_path / "lora-local", rank=4, seed=3)
    with LocalHub() as hub:
        hub.add_repo("parallm-test/tiny", tiny_repo_dir)
        hub.add_repo("parallm-test/tiny-lora", _copy(adapter, tmp_path / "lora-repo"),
                     extra={"README.md": b"# card\n"})
        hub.add_repo("parallm-test/other-lora", _copy(adapter, tmp_path / "other-repo"))
        got, _ = run_child(ADAPTER_BY_ID.format(spec="parallm-test/tiny", adapter="parallm-test/tiny-lora",
                                                local=str(tiny_repo_dir), local_adapter=str(adapter)),
                           tmp_path / "hf", hub.url)
        asked = [path for _, path in hub.requests]
    assert "error" not in got, got
    assert got["got"] == got["want"] != got["base"]  # the adapter changes the answer, the same way
    assert "nobody/no-such-adapter" in got["missing"]
    assert "parallm-test/other-lora" in got["by_request"]
    assert not any(p.endswith("README.md") for p in asked)
    assert not any("other-lora" in p for p in asked)
