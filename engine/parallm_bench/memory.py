"""The ``memory`` workload of `parallm bench`: what the agent fan-out holds in memory.

``requests`` (32) prompts share one ``prefix_tokens`` (2,000) prefix and differ in a short own suffix
(``suffix_tokens``, 32); each generates ``new_tokens`` (32), greedy, EOS ignored, all submitted at once.
Two systems, **each in a process of its own** (``python -m parallm_bench.memory``, one after the
other) so that neither's peak memory includes the other's:

- ``parallm``: an ``Engine`` on the bench's model (same backend, same batch size), the prompts through
  ``engine.generate``. KV: the engine's own gauges (``peak_kv_bytes``: the running batch at its largest,
  a shared prefix counted once; ``peak_kv_bytes_held``, where the engine has it: running batch + prefix
  cache, each byte once; ``memory``: running rows and prefix cache, sampled every 20 ms).
- ``parallm_kv8`` / ``parallm_kv4``: the same engine with its KV stored at 8 / 4 bits (``Engine(kv_bits=)``):
  peak KV and tok/s against ``parallm``, and the logprob drift that costs (``bench_kv_quant``, teacher-forced
  on the bench's model, in the parent process).
- ``mlx_lm_batch``: mlx-lm's ``BatchGenerator`` on the same weights (``loader.load_model``, the engine's
  dtype), with its prompt cache: the prefix prefilled once, deep-copied into every request's cache (the
  ``fanout`` baseline). KV: the sum of its caches' ``nbytes`` (pending requests' caches, the prompt
  batch's and the generation batch's), read after every step; these are mlx-lm 0.32's private fields.

Each process reports its peak resident set after the model is loaded: the kernel's RSS high-water mark
is reset once the weights are in (``/proc/self/clear_refs``, Linux) and read at the end
(``peak_rss_after_load_mb``); where that reset is not possible the whole process's ``ru_maxrss`` is
given instead (``rss_peak_includes_load``: true). ``rss_after_load_mb`` is the RSS before the run.

The bound: KV held should stay within ``1.2 x (prefix + requests x (suffix + new)) x bytes per token``,
the KV of the prefix once plus every request's own tokens, with 20% for allocation rounding
(``kv_bound_bytes``; ``kv_vs_bound`` = the running batch's peak / bound, ``kv_held_vs_bound`` = the peak
held with the prefix cache / bound; <= 1 meets it).

JSON::

    {"sizes": {...}, "bytes_per_token": b, "kv_bound_bytes": n,
     "parallm": {"peak_kv_bytes", "kv_bytes_max_sampled", "memory", "peak_rss_after_load_mb", ...},
     "mlx_lm_batch": {"peak_kv_bytes", "peak_rss_after_load_mb", ...},
     "ratios": {"kv_mlx_lm_vs_parallm": x, "rss_growth_mlx_lm_vs_parallm": y, "kv_vs_bound": z, ...}}
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

from parallm_engine.kv.kv_quant import KVFormat

MB = 2**20


@dataclass
class MemorySizes:
    requests: int = 32
    prefix_tokens: int = 2000
    suffix_tokens: int = 32
    new_tokens: int = 32
    seed: int = 16


FULL_MEMORY = MemorySizes()
QUICK_MEMORY = MemorySizes(requests=8, prefix_tokens=512, suffix_tokens=16, new_tokens=8)
BOUND_FACTOR = 1.2


def build_prompts(vocab: int, sz: MemorySizes) -> list[list[int]]:
    """The shared prefix + a distinct suffix per request, seeded ordinary-token ids."""
    rng = random.Random(sz.seed)
    prefix = [rng.randrange(300, vocab) for _ in range(sz.prefix_tokens)]
    return [prefix + [rng.randrange(300, vocab) for _ in range(sz.suffix_tokens)] for _ in range(sz.requests)]


# -- process memory ----------------------------------------------------------------------------------

def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_rss_peak() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS; False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return _status_kb("VmHWM") is not None
    except OSError:
        return False


def _rss_mb() -> float:
    kb = _status_kb("VmRSS")
    return round(kb / 1024, 1) if kb is not None else 0.0


def _peak_rss_mb(reset_ok: bool) -> float:
    if reset_ok:
        return round(_status_kb("VmHWM") / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


def _digest(outputs: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


# -- the two systems (each runs in a worker process) ----------------------------------------------------

def _run_parallm(job: dict) -> dict:
    from parallm_engine.core.engine import Engine

    cfg = {k: job[k] for k in ("backend", "max_batch_size", "kv_bits") if job.get(k)}
    engine = Engine(job["model"], **cfg)
    try:
        engine.generate([[300, 301, 302]], max_tokens=2, temperature=0)  # warm-up (kernels, first graph)
        engine.clear_prefix_cache()
        engine.reset_peaks()
        rss_load = _rss_mb()
        reset_ok = _reset_rss_peak()
        sampled = [0]
        done = threading.Event()

        def sample():
            while not done.wait(0.02):
                mem = engine.stats().get("memory") or {}
                sampled[0] = max(sampled[0], mem.get("kv_bytes_running", 0) + mem.get("kv_bytes_prefix_cache", 0))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        results = engine.generate(job["prompts"], max_tokens=job["new_tokens"], temperature=0, ignore_eos=True)
        wall = time.perf_counter() - t0
        done.set()
        sampler.join()
        stats = engine.stats()
        outputs = [list(r.token_ids) for r in results]
        return {
            "peak_kv_bytes": stats["peak_kv_bytes"], "kv_bytes_max_sampled": sampled[0],
            # Running batch + prefix cache with each byte once (a shared prefix that is the tree's own
            # arrays counted once), where the engine has that gauge.
            "peak_kv_bytes_held": stats.get("peak_kv_bytes_held"),
            "memory": stats.get("memory") or {}, "bytes_per_token": engine.model_info.kv_bytes_per_token(),
            "prefill_tokens": stats["prefill_tokens"], "backend": engine.backend.name,
            "kv_bytes_per_token": (stats.get("memory") or {}).get("kv_bytes_per_token"),
            "tokens_per_s": round(len(outputs) * job["new_tokens"] / wall, 1),
            **_common(outputs, wall, rss_load, reset_ok),
        }
    finally:
        engine.shutdown()


def _generator_kv_bytes(gen) -> int:
    """KV bytes a BatchGenerator holds: its pending requests' caches, its prompt batch's and its
    generation batch's (mlx-lm 0.32 keeps them in these fields)."""
    caches = []
    for seq in getattr(gen, "_unprocessed_sequences", ()):
        caches += list(seq[3] or [])
    for batch in (getattr(gen, "_prompt_batch", None), getattr(gen, "_generation_batch", None)):
        caches += list(getattr(batch, "prompt_cache", None) or [])
    return sum(int(getattr(c, "nbytes", 0) or 0) for c in caches)


def _run_mlx_lm_batch(job: dict) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    from parallm_engine.models.loader import load_model

    model, _tokenizer, _info = load_model(job["model"])
    prompts, p, new = job["prompts"], job["prefix_len"], job["new_tokens"]
    rss_load = _rss_mb()
    reset_ok = _reset_rss_peak()
    t0 = time.perf_counter()
    prefix_cache = make_prompt_cache(model)
    model(mx.array(prompts[0][:p])[None], cache=prefix_cache)
    mx.eval([c.state for c in prefix_cache])
    caches = [copy.deepcopy(prefix_cache) for _ in prompts]
    del prefix_cache
    n = len(prompts)
    gen = BatchGenerator(model, max_tokens=new, stop_tokens=None, completion_batch_size=n, prefill_batch_size=n)
    uids = gen.insert([q[p:] for q in prompts], [new] * n, caches=caches)
    del caches  # from here the generator holds them
    outputs: dict[int, list[int]] = {u: [] for u in uids}
    peak_kv = _generator_kv_bytes(gen)
    while responses := gen.next_generated():
        for r in responses:
            outputs[r.uid].append(int(r.token))
        peak_kv = max(peak_kv, _generator_kv_bytes(gen))
    wall = time.perf_counter() - t0
    gen.close()
    return {"peak_kv_bytes": peak_kv, **_common([outputs[u] for u in uids], wall, rss_load, reset_ok)}


def _common(outputs, wall, rss_load, reset_ok) -> dict:
    tokens = sum(map(len, outputs))
    return {
        "tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2) if wall else 0.0,
        "outputs_digest": _digest(outputs), "rss_after_load_mb": rss_load,
        "peak_rss_after_load_mb": _peak_rss_mb(reset_ok), "rss_peak_includes_load": not reset_ok,
    }


SYSTEMS = {"parallm": _run_parallm, "mlx_lm_batch": _run_mlx_lm_batch,
           "parallm_kv8": lambda job: _run_parallm({**job, "kv_bits": 8}),
           "parallm_kv4": lambda job: _run_parallm({**job, "kv_bits": 4})}


def run_system_in_process(system: str, job: dict, timeout: float = 3600) -> dict:
    """``system`` on ``job`` in a fresh Python process; its JSON result."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({**job, "system": system}, fh)
    try:
        done = subprocess.run([sys.executable, "-m", "parallm_bench.memory", fh.name],
                              capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(fh.name)
    if done.returncode != 0:
        raise RuntimeError(f"memory workload: the {system} process failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_memory_workload(engine, sz: MemorySizes, tick=None) -> dict:
    tick = tick or (lambda msg: None)
    info = engine.model_info
    room = engine.context_window - sz.suffix_tokens - sz.new_tokens - 1
    if sz.prefix_tokens > room:  # the prefix is cut to the context window, and the sizes say so
        sz = MemorySizes(**{**asdict(sz), "prefix_tokens": max(1, room)})
    prompts = build_prompts(info.vocab_size, sz)
    job = {"model": str(info.source), "backend": engine.backend.name, "max_batch_size": engine.config.max_batch_size,
           "prompts": prompts, "prefix_len": sz.prefix_tokens, "new_tokens": sz.new_tokens}
    entry: dict = {"sizes": asdict(sz)}
    kv_formats = _kv_formats(engine)
    for system in SYSTEMS:
        if system.startswith("parallm_kv") and not isinstance(kv_formats[int(system[10:])], KVFormat):
            continue  # the model cannot store quantized KV: the error is in entry["kv_quant"]
        tick(f"memory: {system} (own process)")
        entry[system] = run_system_in_process(system, job)
    p, m = entry["parallm"], entry["mlx_lm_batch"]
    per_token = p.get("bytes_per_token") or info.kv_bytes_per_token()
    own = sz.suffix_tokens + sz.new_tokens
    ideal = (sz.prefix_tokens + sz.requests * own) * per_token
    bound = int(BOUND_FACTOR * ideal)
    growth = lambda s: max(s["peak_rss_after_load_mb"] - s["rss_after_load_mb"], 0.0)
    entry.update({
        "bytes_per_token": per_token, "kv_ideal_bytes": ideal, "kv_bound_bytes": bound,
        "kv_private_bytes": sz.requests * (sz.prefix_tokens + own) * per_token,
        "same_tokens": p["outputs_digest"] == m["outputs_digest"],
    })
    entry["ratios"] = {
        "kv_mlx_lm_vs_parallm": round(m["peak_kv_bytes"] / p["peak_kv_bytes"], 2) if p["peak_kv_bytes"] else None,
        "peak_rss_mlx_lm_vs_parallm": round(m["peak_rss_after_load_mb"] / p["peak_rss_after_load_mb"], 2)
        if p["peak_rss_after_load_mb"] else None,
        "rss_growth_mlx_lm_vs_parallm": round(growth(m) / growth(p), 2) if growth(p) > 0 else None,
        "kv_vs_bound": round(p["peak_kv_bytes"] / bound, 3) if bound else None,
        "kv_with_prefix_cache_vs_bound": round(p["kv_bytes_max_sampled"] / bound, 3) if bound else None,
    }
    if p.get("peak_kv_bytes_held"):
        entry["ratios"]["kv_held_vs_bound"] = round(p["peak_kv_bytes_held"] / bound, 3)
    entry["kv_quant"] = _kv_quant_rows(engine, entry, kv_formats, tick)
    return entry


def _kv_formats(engine) -> dict:
    """Per bit width, the model's quantized KV format, or why it has none."""
    from parallm_engine.kv import kv_quant

    sched, out = engine._scheduler, {}
    for bits in (8, 4):
        try:
            out[bits] = kv_quant.format_for_model(bits, engine.model, sched.n_layers, sched.layout)
        except kv_quant.KVQuantizationError as exc:
            out[bits] = str(exc)
    return out


def _kv_quant_rows(engine, entry: dict, kv_formats: dict, tick) -> dict:
    """KV quantization on vs off: peak KV held, tok/s, same tokens as float, and the logprob drift."""
    from parallm_bench.kv_quant import logprob_drift

    p, out = entry["parallm"], {}
    sched = engine._scheduler
    for bits in (8, 4):
        fmt = kv_formats[bits]
        if not isinstance(fmt, KVFormat):
            out[f"kv{bits}"] = {"error": fmt}
            continue
        q = entry[f"parallm_kv{bits}"]
        row = {"peak_kv_bytes_held": q.get("peak_kv_bytes_held"), "tokens_per_s": q["tokens_per_s"],
               "kv_bytes_per_token": q.get("kv_bytes_per_token"),
               "same_tokens_as_float": q["outputs_digest"] == p["outputs_digest"]}
        if p.get("peak_kv_bytes_held") and q.get("peak_kv_bytes_held"):
            row["kv_held_float_vs_quantized"] = round(p["peak_kv_bytes_held"] / q["peak_kv_bytes_held"], 2)
        row["tok_s_vs_float"] = round(q["tokens_per_s"] / p["tokens_per_s"], 2) if p.get("tokens_per_s") else None
        tick(f"memory: logprob drift at {bits}-bit KV")
        row["drift"] = engine.run_on_engine_thread(
            lambda: logprob_drift(engine.model, engine.tokenizer, sched.n_layers, fmt))
        out[f"kv{bits}"] = row
    return out


def format_lines(entry: dict) -> list[str]:
    sz, p, m, r = entry["sizes"], entry["parallm"], entry["mlx_lm_batch"], entry["ratios"]
    rss = lambda s: (f"peak RSS {s['peak_rss_after_load_mb']:.0f} MB "
                     + ("(whole process)" if s["rss_peak_includes_load"] else f"(after load {s['rss_after_load_mb']:.0f})"))
    return [
        f"memory: {sz['requests']} requests over a {sz['prefix_tokens']}-token shared prefix + {sz['suffix_tokens']} own "
        f"tokens, {sz['new_tokens']} new, each system in its own process: peak KV ParaLLM "
        f"{p['peak_kv_bytes'] / MB:.1f} MB vs mlx-lm BatchGenerator {m['peak_kv_bytes'] / MB:.1f} MB; "
        f"ParaLLM {rss(p)} vs BatchGenerator {rss(m)}; same tokens: {entry['same_tokens']}",
        f"  KV bound 1.2 x (prefix + {sz['requests']} x own tokens) x {entry['bytes_per_token']} B/token = "
        f"{entry['kv_bound_bytes'] / MB:.1f} MB: running batch at its peak {p['peak_kv_bytes'] / MB:.1f} MB "
        f"({r['kv_vs_bound']:.2f}x the bound), " + (
            f"held with the prefix cache (each byte once) at its peak {p['peak_kv_bytes_held'] / MB:.1f} MB "
            f"({r['kv_held_vs_bound']:.2f}x)" if r.get("kv_held_vs_bound") is not None else
            f"running + prefix cache at most {p['kv_bytes_max_sampled'] / MB:.1f} MB "
            f"({r['kv_with_prefix_cache_vs_bound']:.2f}x; the batch's shared prefix is the cache's own copy, "
            "counted in both)") + f"; private copies would be {entry['kv_private_bytes'] / MB:.1f} MB",
    ] + [_kv_quant_line(bits, q, p) for bits, q in ((b, entry.get("kv_quant", {}).get(f"kv{b}")) for b in (8, 4)) if q]


def _kv_quant_line(bits: int, q: dict, p: dict) -> str:
    if "error" in q:
        return f"  KV {bits}-bit: not run ({q['error']})"
    d = q["drift"]
    return (f"  KV {bits}-bit (Engine(kv_bits={bits})): peak KV held {(q['peak_kv_bytes_held'] or 0) / MB:.1f} MB "
            f"({q.get('kv_held_float_vs_quantized')}x less than float), {q['tokens_per_s']} tok/s "
            f"({q['tok_s_vs_float']}x float's {p.get('tokens_per_s')}); logprob drift vs float mean "
            f"{d['mean_abs_logprob_drift']}, max {d['max_abs_logprob_drift']}, top-1 agreement "
            f"{d['top1_agreement']:.1%} over {d['positions']} positions")


def _worker_main(path: str) -> int:
    import parallm_engine  # noqa: F401  (preloads the BLAS before mlx, as every ParaLLM process does)

    with open(path) as fh:
        job = json.load(fh)
    out = SYSTEMS[job["system"]](job)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
