"""`parallm bench --workloads embed`: texts per second, embedding on the shared engine vs one at a time.

The model is a random-weight Qwen3-Embedding (qwen3 architecture, last-token pooling, normalised, with
the sentence-transformers files the real one ships) at Qwen3-Embedding-0.6B's width (hidden 1024, 16/8
heads, MLP 3072) with ``layers`` of its 28 layers (``--quick``: a 2-layer, 64-wide model), and the default
model's tokenizer. Texts are ``texts`` passages of 20-120 words. Measured on one engine, same run:

- ``sequential``: the same library's model (mlx-lm's qwen3 class, the engine's weights) one text at a
  time: ``model.model(ids)``, last token, normalise (what a loop over ``embed_query`` does elsewhere).
- ``parallm_c{1,16,64}``: the texts through ``Engine.aembed`` with at most c in flight at once.
- ``ceiling``: what batching can gain at all on this machine: mlx-lm's own model on the same number of texts,
  every one cut to the mean length (no padding, no engine), one at a time and ``rows`` at once. Where one
  text's forward already runs the matmuls near the machine's peak (a CPU), no batching engine can beat the
  ``rows``-at-once figure; on a GPU a single short text leaves most of it idle, and the ratio is large.
- ``beside_generation``: a burst of ``burst`` texts in one ``embed`` call (what ``embed_documents`` sends)
  while ``streams`` chat streams decode on the same engine: the streams' inter-token latency p50 during the
  burst and alone (``itl_ratio``: the burst should at most double it), the mean beside it
  (``itl_mean_ratio``: what the texts cost the streams on average), and the burst's texts/s.

Numbers from a shared machine vary: compare ratios within one run.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

FULL_EMBED = {"hidden": 1024, "layers": 4, "heads": 16, "kv_heads": 8, "mlp": 3072, "texts": 64, "streams": 8,
              "new_tokens": 48, "burst": 1000}
QUICK_EMBED = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "mlp": 128, "texts": 64, "streams": 8,
               "new_tokens": 16, "burst": 200}
CONCURRENCY = (1, 16, 64)

_WORDS = ("model engine batch token vector query passage search answer river mountain city paris france capital "
          "the a of to in is was and or not what where who how why when retrieve relevant document text").split()


def write_sentence_transformers(out: Path, pooling: str, query_prompt: str = "", dims: int = 0) -> None:
    """Qwen3-Embedding's sentence-transformers files: Transformer -> Pooling (``pooling``) -> Normalize."""
    flags = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": dims, **{f: f == flags[pooling] for f in flags.values()}}))
    (out / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": query_prompt, "document": ""}, "default_prompt_name": None,
         "similarity_fn_name": "cosine"}))


def build_embedder(out: Path, sizes: dict, sentence_transformers: bool = True) -> Path:
    """A random-weight qwen3 embedding model with the default model's tokenizer (without the
    sentence-transformers files: a plain qwen3 of that shape, e.g. a reranker's)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    from parallm_engine.models.loader import resolve_model

    tok_dir, _ = resolve_model(None)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok_dir / name).exists():
            shutil.copy(tok_dir / name, out / name)
    vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    config = {"model_type": "qwen3", "hidden_size": sizes["hidden"], "num_hidden_layers": sizes["layers"],
              "intermediate_size": sizes["mlp"], "num_attention_heads": sizes["heads"],
              "num_key_value_heads": sizes["kv_heads"], "head_dim": sizes["hidden"] // sizes["heads"],
              "rms_norm_eps": 1e-6, "vocab_size": vocab, "max_position_embeddings": 8192, "rope_theta": 1e6,
              "tie_word_embeddings": True}
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    if sentence_transformers:
        write_sentence_transformers(out, "last", dims=sizes["hidden"])
    return out


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 120))) for _ in range(n)]


def run_sequential(engine, ids_list: list[list[int]]) -> dict:
    """mlx-lm's own model on the engine's weights, one text at a time (on the engine thread, idle meanwhile)."""
    import mlx.core as mx

    inner = engine.model.model

    def loop():
        t0 = time.perf_counter()
        for ids in ids_list:
            v = inner(mx.array([ids]))[0, -1]
            mx.eval(v / mx.linalg.norm(v))
        return time.perf_counter() - t0

    wall = engine.run_on_engine_thread(loop)
    return {"texts": len(ids_list), "wall_s": round(wall, 3), "texts_per_s": round(len(ids_list) / wall, 2)}


def run_ceiling(engine, ids_list: list[list[int]], rows=(8, 64)) -> dict:
    """mlx-lm's own model, texts of one length (each cut or repeated to the mean): one at a time vs ``rows`` at
    once, no padding (the most packing could give), best of two passes each."""
    import mlx.core as mx

    inner = engine.model.model
    n = max(1, sum(map(len, ids_list)) // len(ids_list))
    same = [(ids * (n // max(1, len(ids)) + 1))[:n] for ids in ids_list]

    def timed(width: int) -> float:
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            for k in range(0, len(same), width):
                mx.eval(inner(mx.array(same[k:k + width]))[:, -1])
            best = min(best, time.perf_counter() - t0)
        return best

    def loop():
        return {w: timed(w) for w in (1, *rows)}

    walls = engine.run_on_engine_thread(loop)
    out = {"tokens_per_text": n, "one_at_a_time_texts_per_s": round(len(same) / walls[1], 2)}
    for w in rows:
        out[f"rows_{w}_texts_per_s"] = round(len(same) / walls[w], 2)
        out[f"rows_{w}_vs_one"] = round(walls[1] / walls[w], 2)
    return out


async def _embed_concurrent(engine, texts: list[str], concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(t: str):
        async with sem:
            await engine.aembed(t)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(t) for t in texts))
    return time.perf_counter() - t0


def run_parallm(engine, texts: list[str], concurrency: int) -> dict:
    wall = asyncio.run(_embed_concurrent(engine, texts, concurrency))
    return {"texts": len(texts), "concurrency": concurrency, "wall_s": round(wall, 3),
            "texts_per_s": round(len(texts) / wall, 2)}


def _generation(engine, streams: int, new_tokens: int, vocab: int):
    rng = random.Random(1)
    prompts = [[rng.randrange(256, vocab) for _ in range(24)] for _ in range(streams)]
    return [engine.submit(p, temperature=0.0, max_tokens=new_tokens, ignore_eos=True) for p in prompts]


def _arrivals(handles) -> list[list[float]]:
    """Each stream's token arrival times (one reader thread per stream, as separate callers would)."""
    import threading

    times: list[list[float]] = [[] for _ in handles]

    def read(i: int, h) -> None:
        last = None
        for d in h:  # a delta of k tokens: k arrivals spread over the gap since the last one
            now, k = time.perf_counter(), len(d.token_ids)
            if k:
                start = now if last is None else last
                times[i] += [start + (now - start) * (j + 1) / k for j in range(k)]
                last = now

    threads = [threading.Thread(target=read, args=(i, h), daemon=True) for i, h in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times


def _gaps(times: list[list[float]], start: float = 0.0, end: float = float("inf")) -> list[float]:
    return sorted(b - a for ts in times for a, b in zip(ts, ts[1:]) if start <= a and b <= end)


def _itl_p50(times: list[list[float]], start: float = 0.0, end: float = float("inf")) -> float:
    gaps = _gaps(times, start, end)
    return gaps[len(gaps) // 2] if gaps else 0.0


def _itl_mean(times: list[list[float]], start: float = 0.0, end: float = float("inf")) -> float:
    gaps = _gaps(times, start, end)
    return sum(gaps) / len(gaps) if gaps else 0.0


def run_beside_generation(engine, texts: list[str], sizes: dict) -> dict:
    import threading

    vocab = engine.model_info.vocab_size
    alone_times = _arrivals(_generation(engine, sizes["streams"], sizes["new_tokens"], vocab))
    alone, alone_mean = _itl_p50(alone_times), _itl_mean(alone_times)
    burst = _texts(sizes["burst"], seed=9)
    chats = _generation(engine, sizes["streams"], sizes["new_tokens"] * 40, vocab)  # outlast the burst
    window: dict = {}

    def embed_burst() -> None:
        time.sleep(0.2)  # every stream decoding before the texts arrive
        window["start"] = time.perf_counter()
        engine.embed(burst, wait=True)  # as embed_documents: windowed under the queue bound
        window["end"] = time.perf_counter()
        for h in chats:  # the streams' job was to decode beside the burst: stop them
            h.abort()

    worker = threading.Thread(target=embed_burst, daemon=True)
    worker.start()
    times = _arrivals(chats)
    worker.join()
    span = (window["start"], window["end"])
    during, during_mean = _itl_p50(times, *span), _itl_mean(times, *span)
    wall = window["end"] - window["start"]
    return {"texts": len(burst), "wall_s": round(wall, 3), "texts_per_s": round(len(burst) / wall, 2),
            "streams": sizes["streams"], "itl_p50_alone_ms": round(alone * 1e3, 2),
            "itl_p50_during_ms": round(during * 1e3, 2), "itl_ratio": round(during / alone, 2) if alone else 0.0,
            "itl_mean_alone_ms": round(alone_mean * 1e3, 2), "itl_mean_during_ms": round(during_mean * 1e3, 2),
            "itl_mean_ratio": round(during_mean / alone_mean, 2) if alone_mean else 0.0}


def run_embed(sizes: dict, tick=None, backend: str | None = None) -> dict:
    """The embed workload on its own random model and engine (the loaded chat model is not an embedder)."""
    from parallm_engine.core.engine import Engine

    tick = tick or (lambda msg: None)
    tmp = Path(tempfile.mkdtemp(prefix="parallm-bench-embed-"))
    engine = None
    try:
        path = build_embedder(tmp / "qwen3-embedding-bench", sizes)
        engine = Engine(str(path), backend=backend)
        texts = _texts(sizes["texts"])
        engine.embed(texts[:4])  # warm-up
        ids = [engine.encode(t) for t in texts]
        out = {"model": {k: sizes[k] for k in ("hidden", "layers", "heads", "kv_heads", "mlp")},
               "mean_tokens": round(sum(map(len, ids)) / len(ids), 1), "sequential": run_sequential(engine, ids)}
        tick("embed sequential")
        out["ceiling"] = run_ceiling(engine, ids)
        tick("embed ceiling")
        for c in CONCURRENCY:
            out[f"parallm_c{c}"] = run_parallm(engine, texts, c)
            tick(f"embed c={c}")
        out["beside_generation"] = run_beside_generation(engine, texts, sizes)
        tick("embed beside generation")
        seq = out["sequential"]["texts_per_s"]
        out["ratios"] = {f"c{c}_vs_sequential": round(out[f"parallm_c{c}"]["texts_per_s"] / seq, 2)
                         for c in CONCURRENCY}
        out["ratios"]["beside_generation_vs_sequential"] = round(out["beside_generation"]["texts_per_s"] / seq, 2)
        return out
    finally:
        if engine is not None:
            engine.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def format_lines(entry: dict) -> list[str]:
    m = entry["model"]
    lines = [f"embed: random qwen3 embedder (hidden {m['hidden']}, {m['layers']} layers), "
             f"{entry['sequential']['texts']} texts of ~{entry['mean_tokens']} tokens; texts/s"]
    lines.append(f"  one at a time (mlx-lm model.model): {entry['sequential']['texts_per_s']}")
    for c in CONCURRENCY:
        lines.append(f"  parallm, {c} concurrent: {entry[f'parallm_c{c}']['texts_per_s']} "
                     f"({entry['ratios'][f'c{c}_vs_sequential']}x)")
    if "ceiling" in entry:  # (older results lack it)
        c = entry["ceiling"]
        widths = sorted(int(k.split("_")[1]) for k in c if k.endswith("_vs_one"))
        lines.append(f"  ceiling: mlx-lm's model on texts of one length ({c['tokens_per_text']} tokens, no padding), "
                     + ", ".join(f"{w} at once {c[f'rows_{w}_vs_one']}x" for w in widths)
                     + f" one at a time ({c['one_at_a_time_texts_per_s']} texts/s): the most batching gains here")
    b = entry["beside_generation"]
    lines.append(f"  a burst of {b['texts']} texts beside {b['streams']} decoding chat streams: {b['texts_per_s']} "
                 f"({entry['ratios']['beside_generation_vs_sequential']}x); the streams' ITL p50 "
                 f"{b['itl_p50_during_ms']} ms during vs {b['itl_p50_alone_ms']} ms alone ({b['itl_ratio']}x)"
                 + (f", mean {b['itl_mean_during_ms']} vs {b['itl_mean_alone_ms']} ms ({b['itl_mean_ratio']}x)"
                    if "itl_mean_ratio" in b else ""))
    return lines
