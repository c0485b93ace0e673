"""Two benchmark workloads about the engine itself rather than its peers.

- ``paths``: the agent fan-out (many requests continuing one cached prefix) on the native CPU path and on
  the pure-MLX path (``backend="cpu-mlx"``: MLX's own ops, what Metal and CUDA run), with the same
  prompts: wall time, peak KV bytes, and whether the greedy tokens are the same.
- ``arrival``: running streams decoding while a long prompt arrives: their inter-token latency before
  and while it is prefilled (the step-time target cuts the prefill into pieces between decode steps),
  and the long request's time to first token.
"""

from __future__ import annotations

import random
import threading
import time


def _pct(values, q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q * (len(v) - 1)))))]


def _fanout_prompts(vocab: int, n: int, prefix_len: int, suffix_len: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(300, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(300, vocab) for _ in range(suffix_len)] for _ in range(n)]


def run_paths(model_spec, vocab: int, n: int = 32, prefix_len: int = 512, suffix_len: int = 16,
              new_tokens: int = 32) -> dict:
    """The fan-out on ``cpu-native`` and ``cpu-mlx`` engines of the same model, one after the other."""
    from parallm_engine.core.engine import Engine

    prompts = _fanout_prompts(vocab, n, prefix_len, suffix_len)
    out: dict = {"requests": n, "prefix_len": prefix_len, "new_tokens": new_tokens}
    tokens = {}
    for name in ("cpu-native", "cpu-mlx"):
        eng = Engine(model_spec, backend=name)
        try:
            eng.generate([prompts[0][:prefix_len] + [301]], max_tokens=2, temperature=0)  # warm-up
            eng.clear_prefix_cache()
            eng.reset_peaks()
            t0 = time.perf_counter()
            results = eng.generate(prompts, max_tokens=new_tokens, temperature=0, ignore_eos=True)
            wall = time.perf_counter() - t0
            stats = eng.stats()
            tokens[name] = [r.token_ids for r in results]
            out[name] = {
                "backend": eng.backend.name,
                "wall_s": wall,
                "tok_s": sum(len(t) for t in tokens[name]) / wall,
                "peak_kv_bytes": stats["peak_kv_bytes"],
                "kv_bytes_per_token": eng.model_info.kv_bytes_per_token(),
            }
        finally:
            eng.shutdown()
    out["same_tokens"] = tokens["cpu-native"] == tokens["cpu-mlx"]
    out["mlx_vs_native_wall"] = out["cpu-mlx"]["wall_s"] / out["cpu-native"]["wall_s"]
    return out


def run_arrival(engine, streams: int = 8, long_prompt: int = 6000, new_tokens: int = 160, shorts: int = 0,
                short_tokens: int = 100, short_delay_s: float = 0.3) -> dict:
    """``streams`` requests decode; once they run, a ``long_prompt``-token request arrives, and
    ``short_delay_s`` later ``shorts`` prompts of ``short_tokens`` (distinct, 8 new tokens each). Reports the
    running streams' inter-token latency before it arrived and while it was prefilled, its TTFT, and the
    short prompts' TTFT p50 / max (what a long prompt's prefill makes the prompts behind it wait)."""
    vocab = engine.model_info.vocab_size
    rng = random.Random(11)
    long_prompt = min(long_prompt, engine.context_window - 8)
    stamps: list[list[float]] = [[] for _ in range(streams)]
    handles = [engine.submit([rng.randrange(300, vocab) for _ in range(24)], max_tokens=new_tokens,
                             temperature=0, ignore_eos=True) for _ in range(streams)]

    def consume(i):
        for delta in handles[i]:
            if delta.token_ids:
                stamps[i].append(time.perf_counter())

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    while min(len(s) for s in stamps) < 8:  # every stream is decoding
        time.sleep(0.01)
    arrived = time.perf_counter()
    big = engine.submit([rng.randrange(300, vocab) for _ in range(long_prompt)], max_tokens=1, temperature=0)
    short_ttfts: list[float] = []

    def short(handle, sent):
        first_short = None
        for delta in handle:
            if delta.token_ids and first_short is None:
                first_short = time.perf_counter()
        short_ttfts.append(first_short - sent)

    short_threads = []
    if shorts:
        time.sleep(short_delay_s)
        for _ in range(shorts):
            h = engine.submit([rng.randrange(300, vocab) for _ in range(short_tokens)], max_tokens=8,
                              temperature=0, ignore_eos=True)
            short_threads.append(threading.Thread(target=short, args=(h, time.perf_counter()), daemon=True))
            short_threads[-1].start()
    first = None
    for delta in big:
        if delta.token_ids and first is None:
            first = time.perf_counter()
    for t in threads + short_threads:
        t.join()
    before, during = [], []
    for s in stamps:
        for a, b in zip(s, s[1:]):
            (during if arrived <= b <= (first or b) else before if b < arrived else []).append(b - a)
    return {
        "streams": streams,
        "long_prompt_tokens": long_prompt,
        "long_ttft_s": (first - arrived) if first else None,
        "itl_before_p50_s": _pct(before, 0.5),
        "itl_before_p99_s": _pct(before, 0.99),
        "itl_during_p50_s": _pct(during, 0.5),
        "itl_during_p99_s": _pct(during, 0.99),
        "itl_during_max_s": max(during) if during else 0.0,
        "shorts": shorts,
        "short_ttft_p50_s": _pct(short_ttfts, 0.5) if short_ttfts else None,
        "short_ttft_max_s": max(short_ttfts) if short_ttfts else None,
        "step_time_target_s": engine.config.step_time_target_s,
    }


def format_lines(entry: dict) -> list[str]:
    """The bench table's lines for a ``paths`` or an ``arrival`` result."""
    if "mlx_vs_native_wall" in entry:
        nat, mlx = entry["cpu-native"], entry["cpu-mlx"]
        return [
            f"paths: fan-out of {entry['requests']} on a {entry['prefix_len']}-token prefix: native "
            f"{nat['wall_s']:.2f} s ({nat['tok_s']:.1f} tok/s, peak KV {nat['peak_kv_bytes'] / 2**20:.1f} MiB), "
            f"pure-MLX {mlx['wall_s']:.2f} s ({mlx['tok_s']:.1f} tok/s, peak KV {mlx['peak_kv_bytes'] / 2**20:.1f} MiB); "
            f"pure-MLX / native wall {entry['mlx_vs_native_wall']:.2f}x; same tokens: {entry['same_tokens']}",
        ]
    return [
        f"arrival: {entry['streams']} streams while a {entry['long_prompt_tokens']}-token prompt arrives: ITL "
        f"p50/p99 {entry['itl_before_p50_s']:.3f}/{entry['itl_before_p99_s']:.3f} s before, "
        f"{entry['itl_during_p50_s']:.3f}/{entry['itl_during_p99_s']:.3f} s during its prefill "
        f"(step target {entry['step_time_target_s']} s); its TTFT {entry['long_ttft_s'] or 0:.2f} s"
        + (f"; {entry['shorts']} short prompts sent after it: TTFT p50/max {entry['short_ttft_p50_s']:.2f}/"
           f"{entry['short_ttft_max_s']:.2f} s" if entry.get("short_ttft_p50_s") is not None else ""),
    ]
