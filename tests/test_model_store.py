"""``parallm pull`` and ``parallm models`` on real files in the real layouts: a hub cache filled by pulling
from the local hub server (tests/hub_server.py), an LM Studio models folder (an MLX directory and a GGUF
written with the ``gguf`` package) and an Ollama store (a manifest whose model layer names a GGUF blob by
digest: the embedded model's GGUF)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.hub_server import LocalHub
from tests.test_hub_download import ROOT, default_model_dir, tiny_repo_dir  # noqa: F401  (fixtures)


def parallm(*args: str, home: Path, endpoint: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "OLLAMA_"))}
    env.update(HOME=str(home), HF_HOME=str(home / "hf"), HF_HUB_DISABLE_TELEMETRY="1",
               PARALLM_CACHE_DIR=os.environ.get("PARALLM_CACHE_DIR", str(Path.home() / ".cache" / "parallm")),
               PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'engine'}")
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return subprocess.run([sys.executable, "-m", "parallm_integrations.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def write_gguf(path: Path, arch: str, file_type: int, context: int, size_label: str) -> None:
    """A metadata-complete GGUF header with one small tensor (what the store reads)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_size_label(size_label)
    writer.add_file_type(file_type)
    writer.add_context_length(context)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def ollama_store(root: Path, name: str, tag: str, gguf_file: Path) -> Path:
    """Ollama's layout: manifests/registry.ollama.ai/library/NAME/TAG -> blobs/sha256-<hex> (the GGUF)."""
    digest = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.symlink_to(gguf_file)  # the same bytes; a link keeps the test from copying 100 MB
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "0" * 64,
                   "size": 2},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
             "size": gguf_file.stat().st_size},
            {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64, "size": 10},
        ]}))
    return blob


@pytest.fixture(scope="module")
def machine(tmp_path_factory, tiny_repo_dir, default_model_dir):  # noqa: F811
    """A home directory with all three stores; the hub cache filled by ``parallm pull``."""
    from parallm_engine.models.loader import default_model_path

    home = tmp_path_factory.mktemp("home")
    lms = home / ".lmstudio" / "models"
    shutil.copytree(tiny_repo_dir, lms / "lmstudio-community" / "tiny-llama-MLX")
    (lms / "someone" / "t5-small-GGUF").mkdir(parents=True)
    write_gguf(lms / "someone" / "t5-small-GGUF" / "t5-small.Q8_0.gguf", "t5", 7, 512, "60M")
    blob = ollama_store(home / ".ollama" / "models", "smollm2", "135m", default_model_path())
    dangling = home / ".ollama" / "models" / "manifests" / "registry.ollama.ai" / "library" / "gone" / "latest"
    dangling.parent.mkdir(parents=True)
    dangling.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:" + "f" * 64}]}))
    with LocalHub() as hub:
        hub.add_repo("parallm-test/tiny", tiny_repo_dir)
        pulled = parallm("pull", "parallm-test/tiny", home=home, endpoint=hub.url)
        pulled_json = parallm("pull", "parallm-test/tiny", "--json", home=home, endpoint=hub.url)
        missing = parallm("pull", "nobody/nothing", home=home, endpoint=hub.url)
    return {"home": home, "blob": blob, "pulled": pulled, "pulled_json": pulled_json, "missing": missing}


def test_pull_downloads_and_says_what_it_is(machine):
    out = machine["pulled"]
    assert out.returncode == 0, out.stderr
    assert "Fetching" in out.stderr  # huggingface_hub's progress bar
    assert "family  : llama (LlamaForCausalLM)" in out.stdout
    assert "context : 512 tokens" in out.stdout and "runs    : yes, with mlx-lm" in out.stdout
    info = json.loads(machine["pulled_json"].stdout)
    assert info["family"] == "llama" and info["context_length"] == 512 and info["runs"]
    # hidden 64, 2 layers of attention + MLP, tied 49152 x 64 embedding
    assert info["parameters"] == 49152 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64
    assert Path(info["path"]).is_relative_to(machine["home"] / "hf" / "hub")


def test_pull_of_an_unknown_model_is_a_clear_error(machine):
    out = machine["missing"]
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "error: nobody/nothing: no such model on the hub" in out.stderr


def test_models_lists_every_store(machine):
    out = parallm("models", "--json", home=machine["home"])
    assert out.returncode == 0, out.stderr
    rows = {(r["store"], r["family"]): r for r in json.loads(out.stdout)}
    assert set(rows) == {("embedded", "llama"), ("hf-cache", "llama"), ("lm-studio", "llama"),
                         ("lm-studio", "t5"), ("ollama", "llama")}, rows
    hf = rows[("hf-cache", "llama")]
    assert hf["name"] == "parallm-test/tiny" and hf["runs"] and hf["context_length"] == 512
    mlx_dir = rows[("lm-studio", "llama")]
    assert mlx_dir["runs"] and mlx_dir["name"].endswith("lmstudio-community/tiny-llama-MLX")
    t5 = rows[("lm-studio", "t5")]
    assert not t5["runs"] and "GGUF architecture t5" in t5["note"]
    assert t5["quantization"] == "Q8_0" and t5["parameters"] == 60_000_000 and t5["context_length"] == 512
    ollama = rows[("ollama", "llama")]
    assert ollama["name"] == str(machine["blob"]) and ollama["runs"] and ollama["note"].startswith("smollm2:135m")
    assert ollama["quantization"] == "Q4_1" and ollama["context_length"] == 8192
    table = parallm("models", home=machine["home"]).stdout
    assert table.splitlines()[0].split() == ["MODEL", "STORE", "FAMILY", "PARAMS", "QUANT", "CONTEXT", "SIZE",
                                             "RUNS"]
    assert "parallm-test/tiny" in table and "smollm2:135m" in table


def test_an_ollama_blob_is_a_model_path(machine, tmp_path, monkeypatch):
    """What ``parallm models`` lists is what ``model=`` takes: an Ollama blob has no .gguf suffix."""
    from parallm_engine.models.loader import resolve_model

    monkeypatch.setenv("PARALLM_CACHE_DIR", str(tmp_path))  # its conversion is this test's, not the user's

    path, name = resolve_model(str(machine["blob"]))
    assert (path / "config.json").is_file() and name == machine["blob"].name
