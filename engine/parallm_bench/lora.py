"""`parallm bench --workloads lora`: many LoRA adapters in one batch vs the base model alone.

Four random adapters are written for the loaded model with mlx-lm's own LoRA layers
(:func:`write_random_adapter`: ``mlx_lm.tuner.utils.linear_to_lora_layers``, non-zero B, saved as
``mlx_lm.lora`` saves them) and registered on the engine. Then, alternately (``runs`` times each, the
median reported), 32 requests on the base model alone and the same 32 prompts with the adapters mixed
over them (request i uses adapter i % 4): aggregate tok/s, the peak number of rows decoding at once
(one batch: 32), and the ratio mixed / base. JSON::

    {"requests": 32, "adapters": 4, "rank": 8, "base": {...}, "mixed": {...}, "peak_running_mixed": 32,
     "ratios": {"mixed_vs_base": x}, "adapter_stats": {...}}
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LoraSizes:
    n: int
    adapters: int
    prompt_len: int
    new_tokens: int
    rank: int
    runs: int


FULL_LORA = LoraSizes(32, 4, 100, 128, 8, 2)
QUICK_LORA = LoraSizes(32, 4, 48, 24, 8, 1)


def write_random_adapter(base_dir, out_dir, *, rank: int = 8, scale: float = 20.0, num_layers: int = -1,
                         keys: list[str] | None = None, dora: bool = False, seed: int = 0,
                         b_std: float = 0.01) -> Path:
    """An adapter for the mlx-lm model in ``base_dir`` as ``mlx_lm.lora`` writes one: mlx-lm's own
    ``linear_to_lora_layers`` (LoRA, or DoRA) on the last ``num_layers`` layers (-1: all) and ``keys``
    (None: mlx-lm's default, every linear layer), B drawn from N(0, ``b_std``^2) instead of mlx-lm's zeros
    (and DoRA magnitudes moved 10%) so the adapter changes the output; ``adapters.safetensors`` holds the
    trainable parameters, ``adapter_config.json`` the settings."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model, save_config

    model, _ = load_model(Path(base_dir), lazy=True)  # only the adapted layers' weights are read
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys:
        params["keys"] = list(keys)
    n_layers = len(model.layers) if num_layers < 0 else num_layers
    mx.random.seed(seed)
    linear_to_lora_layers(model, n_layers, params, use_dora=dora)
    for _, module in model.named_modules():
        if "lora_b" in module:
            module.lora_b = mx.random.normal(module.lora_b.shape) * b_std
            if dora:
                module.m = module.m * (1.0 + 0.1 * mx.random.normal(module.m.shape))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    save_config({"fine_tune_type": "dora" if dora else "lora", "num_layers": n_layers, "lora_parameters": params},
                out / "adapter_config.json")
    return out


def run_lora(engine, sizes: LoraSizes = FULL_LORA, tick=None) -> dict:
    from parallm_bench.bench import _prompts, run_parallm

    tick = tick or (lambda msg: None)
    vocab = engine.model_info.vocab_size
    rng = random.Random(4321)
    prompts = [p[: sizes.prompt_len - (i % 7)] for i, p in enumerate(_prompts(rng, sizes.n, sizes.prompt_len, vocab))]
    with tempfile.TemporaryDirectory(prefix="parallm-lora-bench-") as tmp:
        names = []
        for i in range(sizes.adapters):
            tick(f"lora: writing adapter {i + 1}/{sizes.adapters}")
            path = write_random_adapter(engine.model_info.path, Path(tmp) / f"a{i}", rank=sizes.rank, seed=100 + i)
            engine.load_adapter(f"bench-lora-{i}", path)
            names.append(f"bench-lora-{i}")
        mixed_adapters = [names[i % len(names)] for i in range(len(prompts))]
        base_runs, mixed_runs, peaks = [], [], []
        for r in range(sizes.runs):
            tick(f"lora: base-only run {r + 1}")
            base_runs.append(run_parallm(engine, prompts, sizes.new_tokens))
            tick(f"lora: mixed run {r + 1}")
            engine.reset_peaks()
            mixed_runs.append(run_parallm(engine, prompts, sizes.new_tokens, adapters=mixed_adapters))
            peaks.append(engine.stats()["peak_running"])
        stats = engine.stats()["adapters"]
    base, mixed = _median(base_runs), _median(mixed_runs)
    return {"requests": len(prompts), "adapters": sizes.adapters, "rank": sizes.rank, "new_tokens": sizes.new_tokens,
            "base": base, "mixed": mixed, "peak_running_mixed": max(peaks),
            "ratios": {"mixed_vs_base": round(mixed["tok_s"] / base["tok_s"], 3) if base["tok_s"] else 0.0},
            "adapter_stats": stats}


def _median(runs: list[dict]) -> dict:
    best = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    return {**best, "runs_tok_s": [r["tok_s"] for r in runs]}


def format_lines(entry: dict) -> list[str]:
    return [f"lora ({entry['requests']} requests, {entry['adapters']} adapters of rank {entry['rank']}, "
            f"{entry['new_tokens']} new tokens, greedy): base only {entry['base']['tok_s']:.1f} tok/s, mixed "
            f"adapters {entry['mixed']['tok_s']:.1f} tok/s (x{entry['ratios']['mixed_vs_base']:.2f}), "
            f"peak rows decoding together {entry['peak_running_mixed']}; runs base {entry['base']['runs_tok_s']} "
            f"mixed {entry['mixed']['runs_tok_s']}"]


if __name__ == "__main__":  # python -m parallm_bench.lora [--quick]: this workload alone
    import sys

    from parallm_engine.core.registry import get_engine

    eng = get_engine()
    eng.generate([[300, 301, 302]], max_tokens=2, temperature=0)
    res = run_lora(eng, QUICK_LORA if "--quick" in sys.argv else FULL_LORA, print)
    print("\n".join(format_lines(res)))
    print(json.dumps(res, indent=2))
