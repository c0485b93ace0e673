"""The prefix cache's disk tier (``kv/disk_tier.py``, ``kv/disk_store.py``): prefixes outlive the process.

- A prompt's prefix computed in one process is read back in the next (whole blocks, then the tail after the
  last one): reported as cached tokens, the same tokens as the cold run, on both engine paths.
- Prefixes the tree evicts for room are written behind and read back in the same process.
- Damaged files (corrupt, truncated, another block's file under this key) are detected, deleted and
  recomputed around; another model with the same config and the same tokens never matches.
- A writer killed with SIGKILL mid-write leaves nothing a reader trusts; two processes writing at once keep
  the cap; the cap evicts the least recently used blocks.
- Reading is skipped when computing is measured faster; bad ``kv_disk`` values are typed errors;
  ``parallm cache`` lists and clears the store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
from parallm_engine import Engine
from parallm_engine.errors import InvalidRequestError
from parallm_engine.kv.disk_store import DiskStore
from parallm_engine.kv.disk_tier import BLOCK_TOKENS, block_keys

from .conftest import settled_stats, write_tiny_llama
from .model_zoo import prompt_ids

ROOT = Path(__file__).resolve().parents[1]
PREFIX = 3 * BLOCK_TOKENS + 40  # three whole blocks and a tail


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("disk-llama"), max_position_embeddings=2048)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PARALLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _prompts(vocab: int, n: int = 4) -> list[list[int]]:
    shared = prompt_ids(PREFIX, vocab, seed=7)
    return [shared + prompt_ids(9 + i, vocab, seed=100 + i) for i in range(n)]


def _run(model_dir, prompts, **kw):
    """Greedy answers, cached tokens per prompt and the disk tier's stats of one engine (shut down after:
    what its tree holds goes to disk)."""
    eng = Engine(str(model_dir), decode_lanes=1, kv_disk=kw.pop("kv_disk", "1GiB"), **kw)
    try:
        first = eng.generate(prompts[:1], max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
        rest = eng.generate(prompts[1:], max_tokens=12, temperature=0, ignore_eos=True, logprobs=True) \
            if len(prompts) > 1 else []
        results = first + rest
        stats = {k: v for k, v in eng.stats()["memory"].items() if k.startswith("kv_disk")}
        fingerprint = eng._scheduler.kv.disk.model if eng._scheduler.kv.disk is not None else None
    finally:
        eng.shutdown(timeout=30)
    # tokens with their logprobs: a wrong KV read back would show in them even where the argmax holds
    return [(r.token_ids, [t.logprob for t in r.logprobs]) for r in results], [r.usage.cached_tokens for r in results], \
        stats, fingerprint


def _block_files(cache_dir: Path, fingerprint: str, tokens: list[int]) -> list[Path]:
    return [cache_dir / "kv" / fingerprint / k[:2] / f"{k}.kvb" for k in block_keys(fingerprint, None, tokens)]


SCRIPT = textwrap.dedent("""
    import json, sys
    import parallm_engine
    from parallm_engine import Engine
    model, backend, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    eng = Engine(model, backend=backend, decode_lanes=1, kv_disk="1GiB")
    out = eng.generate(prompts, max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    stats = eng.stats()["memory"]
    print(json.dumps({"tokens": [r.token_ids for r in out], "cached": [r.usage.cached_tokens for r in out],
                      "logprobs": [[t.logprob for t in r.logprobs] for r in out],
                      "disk_hits": stats["kv_disk_hit_tokens"]}))
""")


@pytest.mark.parametrize("backend", ["cpu-mlx", "cpu-native"])
def test_a_prefix_computed_in_one_process_is_read_back_in_the_next(model_dir, cache_dir, backend):
    """Two processes in turn, the same prompts: the second reads the shared prefix from disk (its blocks,
    not the tail), every call reports it cached, and the tokens are the first (cold) run's."""
    prompts = _prompts(_vocab(model_dir))
    env = {**os.environ, "PARALLM_CACHE_DIR": str(cache_dir)}
    env.pop("PARALLM_KV_DISK", None)

    def run():
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), backend, json.dumps(prompts)],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert warm["tokens"] == cold["tokens"]
    assert warm["logprobs"] == cold["logprobs"]  # the KV read back is bitwise the KV computed
    assert cold["disk_hits"] == 0
    # every context token but the last (which the first decode step runs) is read back: the shared blocks,
    # then the tail each call's own earlier run left (its question)
    assert warm["cached"] == [len(p) - 1 for p in prompts], warm["cached"]
    assert warm["disk_hits"] >= len(prompts[0]) - 1


def _vocab(model_dir) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def test_evicted_prefixes_are_written_behind_and_read_back(model_dir, cache_dir):
    """A prefix cache too small for two prompts: the first prompt's prefix is evicted for the others, written
    to disk as it leaves, and read back when the first prompt comes again (same tokens as the first time)."""
    vocab = _vocab(model_dir)
    a = prompt_ids(PREFIX, vocab, seed=1)
    others = [prompt_ids(PREFIX, vocab, seed=2 + i) for i in range(3)]
    eng = Engine(str(model_dir), decode_lanes=1, kv_disk="1GiB", prefix_cache_bytes=PREFIX * 600)
    try:
        first = eng.generate([a], max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)[0]
        eng.generate(others, max_tokens=4, temperature=0, ignore_eos=True)
        settled_stats(eng)  # the others retired: the tree is back within its budget, a's prefix evicted
        disk = eng._scheduler.kv.disk
        assert disk.flush(30) and disk.blocks_written >= 3
        assert eng._scheduler.radix.match(a, record=False).length < BLOCK_TOKENS  # not in RAM any more
        again = eng.generate([a], max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)[0]
        everything = settled_stats(eng)
        stats = everything["memory"]
    finally:
        eng.shutdown(timeout=30)
    assert again.token_ids == first.token_ids
    assert [t.logprob for t in again.logprobs] == [t.logprob for t in first.logprobs]
    assert stats["kv_disk_hit_tokens"] == len(a) - 1  # the blocks and the tail: all but the last token
    from parallm_engine.serve.metrics import render_engine_stats

    page = "\n".join(render_engine_stats(everything, "m"))
    assert f'parallm_kv_disk_hit_tokens_total{{model="m"}} {len(a) - 1}' in page
    assert "parallm_kv_disk_written_bytes_total" in page
    assert again.usage.cached_tokens == len(a) - 1


def test_damaged_and_foreign_files_are_never_loaded(model_dir, cache_dir):
    """Corrupt (a flipped byte), truncated, and another block's file under this block's name: each is detected
    by its check, deleted and recomputed around; the answers stay the cold run's."""
    prompts = _prompts(_vocab(model_dir), n=1)
    cold, _, _, fp = _run(model_dir, prompts)
    files = _block_files(cache_dir, fp, prompts[0])
    assert all(f.exists() for f in files[:3])

    data = bytearray(files[1].read_bytes())  # block 1 corrupt: block 0 only
    data[len(data) // 2] ^= 0xFF
    files[1].write_bytes(bytes(data))
    tokens, cached, stats, _ = _run(model_dir, prompts)
    assert tokens == cold and stats["kv_disk_hit_tokens"] == BLOCK_TOKENS and stats["kv_disk_rejected_files"] == 1
    assert cached[0] == BLOCK_TOKENS

    # (the run above wrote blocks 1 and 2 again at shutdown) block 0 truncated: nothing is read
    files[0].write_bytes(files[0].read_bytes()[:-100])
    tokens, cached, stats, _ = _run(model_dir, prompts)
    assert tokens == cold and stats["kv_disk_hit_tokens"] == 0 and stats["kv_disk_rejected_files"] == 1

    files[2].write_bytes(files[1].read_bytes())  # a whole, valid file of another block under block 2's name
    tokens, cached, stats, _ = _run(model_dir, prompts)
    assert tokens == cold and stats["kv_disk_hit_tokens"] == 2 * BLOCK_TOKENS
    assert stats["kv_disk_rejected_files"] == 1


def test_another_model_with_the_same_config_and_tokens_never_matches(model_dir, cache_dir, tmp_path):
    """Same config, same file sizes, other weights: its KV lives under another fingerprint and nothing of the
    first model's is read."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    other = write_tiny_llama(tmp_path / "other", max_position_embeddings=2048)
    model, _ = load(str(other))
    mx.random.seed(1)
    model.update({"model": {"embed_tokens": {"weight": mx.random.normal(model.model.embed_tokens.weight.shape)}}})
    mx.save_safetensors(str(other / "model.safetensors"), dict(tree_flatten(model.parameters())))
    assert (other / "model.safetensors").stat().st_size == (model_dir / "model.safetensors").stat().st_size
    prompts = _prompts(_vocab(model_dir), n=1)
    _, _, _, fp_a = _run(model_dir, prompts)
    cold_b, _, stats_b, fp_b = _run(other, prompts)
    assert fp_a != fp_b and stats_b["kv_disk_hit_tokens"] == 0
    warm_b, _, stats_b2, _ = _run(other, prompts)
    assert warm_b == cold_b and stats_b2["kv_disk_hit_tokens"] == len(prompts[0]) - 1


def test_reading_is_skipped_when_computing_is_measured_faster(model_dir, cache_dir):
    prompts = _prompts(_vocab(model_dir), n=1)
    cold, _, _, _ = _run(model_dir, prompts)
    eng = Engine(str(model_dir), decode_lanes=1, kv_disk="1GiB")
    try:
        disk = eng._scheduler.kv.disk
        assert disk.worth_reading(1000, 10 << 20, None)  # nothing measured yet: read
        disk.read_rate = 1000.0  # bytes a second: far slower than the prefill
        assert not disk.worth_reading(1000, 10 << 20, 5000.0)
        assert disk.worth_reading(1000, 10 << 10, 10.0)  # 10 s of reading against 100 s of prefill
        eng._scheduler._prefill_rate = 5000.0
        out = eng.generate(prompts, max_tokens=12, temperature=0, ignore_eos=True)[0]
        stats = eng.stats()["memory"]
    finally:
        eng.shutdown(timeout=30)
    assert out.token_ids == cold[0][0]
    assert stats["kv_disk_hit_tokens"] == 0 and stats["kv_disk_restores_skipped_slower"] >= 1


WRITER = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, sys.argv[1])
    from parallm_engine.kv.disk_store import DiskStore
    store = DiskStore(sys.argv[2], cap_bytes=int(sys.argv[3]))
    n, size, tag = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    for i in range(n):
        a = np.full(size // 4, i, dtype=np.float32)
        store.write("m", f"{tag}{i:04d}" + "0" * 30, [i, i + 1], [a])
    print("done")
""")


def _valid_blocks(root: Path) -> list[Path]:
    store = DiskStore(root, cap_bytes=1 << 40)
    files = sorted((root / "m").rglob("*.kvb"))
    for f in files:
        key = f.name[: -len(".kvb")]
        i = int(key[1:5])
        block = store.read("m", key, [i, i + 1])
        assert block is not None, f"a block file that does not check: {f}"
        assert np.all(block.arrays[0] == i)
    return files


def test_a_writer_killed_mid_write_leaves_nothing_trusted(tmp_path):
    root = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(ROOT / "engine"), str(root), str(1 << 40), "200",
                             str(64 << 20), "a"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(root.rglob("*.tmp")):
        time.sleep(0.005)
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    stray = list(root.rglob("*.tmp"))
    assert stray, "the writer was not killed in the middle of a write"
    _valid_blocks(root)  # every block file that exists is whole
    old = time.time() - 2 * 3600
    for f in stray:
        os.utime(f, (old, old))
    DiskStore(root, cap_bytes=1 << 40).enforce_cap()  # a later writer sweeps the dead one's temporary files
    assert not list(root.rglob("*.tmp"))


def test_two_processes_writing_at_once_keep_the_cap(tmp_path):
    root = tmp_path / "store"
    cap = 12 << 20
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(ROOT / "engine"), str(root), str(cap), "30",
                               str(1 << 20), tag], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for tag in ("a", "b")]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    files = _valid_blocks(root)
    assert sum(f.stat().st_size for f in files) <= cap
    assert len(files) >= 8  # the cap's worth is kept, not everything deleted


def test_the_cap_evicts_the_least_recently_used_blocks(tmp_path):
    one = np.zeros(1 << 18, dtype=np.float32)  # 1 MiB
    store = DiskStore(tmp_path, cap_bytes=int(3.5 * (1 << 20)))
    for i in range(3):
        store.write("m", f"k{i}", [i], [one])
    for i, f in enumerate(sorted((tmp_path / "m").rglob("*.kvb"))):  # distinct ages: k0 oldest
        os.utime(f, (1000 + i, 1000 + i))
    assert store.read("m", "k0", [0]) is not None  # read: now the most recently used
    store.write("m", "k3", [3], [one])
    left = sorted(f.name for f in (tmp_path / "m").rglob("*.kvb"))
    assert left == ["k0.kvb", "k2.kvb", "k3.kvb"]


def test_bad_kv_disk_values_are_typed_errors(model_dir, cache_dir, tmp_path):
    from parallm_engine import settings

    for bad in ("lots", -1, 1.5, True):
        with pytest.raises(InvalidRequestError) as err:
            Engine(str(model_dir), kv_disk=bad)
        assert err.value.param == "kv_disk"
    assert settings.parse_size("8GiB") == 8 << 30 and settings.parse_size("512MiB") == 512 << 20
    assert settings.parse_size("0") == 0
    eng = Engine(str(model_dir), kv_disk=0)
    try:
        assert eng._scheduler.kv.disk is None and eng.config.kv_disk is None
    finally:
        eng.shutdown()
    wide = write_tiny_llama(tmp_path / "wide", head_dim=32, num_attention_heads=2, num_key_value_heads=1)
    eng = Engine(str(wide), kv_disk="1GiB", kv_bits=8)  # quantized KV is not stored
    try:
        assert eng._scheduler.kv.disk is None
    finally:
        eng.shutdown()


def test_parallm_cache_lists_and_clears(model_dir, cache_dir, capsys):
    from parallm_engine import cli

    _run(model_dir, _prompts(_vocab(model_dir), n=1))
    assert cli.main(["cache", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    (model,) = listing["models"]
    assert model["blocks"] >= 3 and model["bytes"] > 0 and model["path"] == str(model_dir)
    assert cli.main(["cache", "--clear"]) == 0
    capsys.readouterr()
    assert cli.main(["cache", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["models"][0]["blocks"] == 0
