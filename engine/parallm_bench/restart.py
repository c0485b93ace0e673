"""The ``restart`` workload of `parallm bench`: the prefix cache's disk tier (``kv/disk_tier.py``) across
processes, each run in a fresh process with an empty disk directory of the workload's own.

- ``script``: what a user's script does twice: one engine, 8 parallel chat calls sharing a long system prompt
  (3,000 tokens full size), greedy. The first process computes the prefix; its engine writes it to disk at
  shutdown; the second process reads it back. Reported per run: TTFT p50 / max of the calls (model load and a
  warm-up excluded), the cached tokens each call reports, whether the answers are the same; and the TTFT
  ratio first / second.
- ``lengths``: one prompt of each length (100 / 1,000 / 8,000 tokens full size) computed in one process
  and, in the next, read back from disk instead (``restore``) or computed again (``recompute``, disk tier
  off): TTFT of both, the read rate and prefill rate each process measured, and what the engine's rule
  (``DiskTier.worth_reading``) picks with them, checked against the faster of the two measured.

JSON::

    {"script": {"system_tokens", "calls", "first": {...}, "second": {...}, "same_outputs", "ttft_p50_ratio"},
     "lengths": [{"tokens", "blocks_tokens", "recompute_ttft_s", "restore_ttft_s", "rule_reads",
                  "faster": "restore" | "recompute", "rule_right"}]}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from parallm_engine.kv.disk_tier import reading_is_faster

#: (system prompt tokens, parallel calls, new tokens, prefix lengths for restore vs recompute)
FULL_RESTART = (3000, 8, 16, (100, 1000, 8000))
QUICK_RESTART = (1200, 8, 8, (100, 1000))

WORDS = ("agent tool schema returns json with fields name type description required enum default items "
         "properties minimum maximum pattern format example note when the user asks call it once").split()


def _system_text(tokenizer, n_tokens: int) -> str:
    """Deterministic prose of about ``n_tokens`` tokens."""
    words, i = [], 0
    text = ""
    while True:
        words.append(WORDS[(i * 7 + i // 5) % len(WORDS)])
        i += 1
        if i % 64 == 0:
            text = " ".join(words)
            if len(tokenizer.encode(text)) >= n_tokens:
                return text


def child(argv: list[str]) -> None:
    """One process of the workload (``python -m parallm_bench.restart MODE MODEL BACKEND ARGS-JSON``)."""
    import time

    import parallm_engine  # noqa: F401  (preloads BLAS before mlx)
    from parallm_engine import Engine

    mode, model, backend, args = argv[0], argv[1], argv[2], json.loads(argv[3])
    eng = Engine(model, backend=backend, kv_disk=args.get("kv_disk", "8GiB"))
    out: dict = {}
    try:
        eng.generate([[300, 301, 302]], max_tokens=2, temperature=0)  # warm-up: first-step compiles
        if mode == "script":
            system = _system_text(eng.tokenizer, args["system_tokens"])
            prompts = [eng.apply_chat_template([{"role": "system", "content": system},
                                                {"role": "user", "content": f"Question {i}: which field comes {i}th?"}])
                       for i in range(args["calls"])]
            handles = [eng.submit(p, max_tokens=args["new_tokens"], temperature=0) for p in prompts]
        else:
            ids = [300 + (i * 7919) % 20000 for i in range(args["tokens"])]
            handles = [eng.submit(ids, max_tokens=2, temperature=0, ignore_eos=True)]
        results = [eng._collect(h) for h in handles]
        ttft = sorted(h.request.ttft() for h in handles)
        mem = eng.stats()["memory"]
        disk = eng._scheduler.kv.disk
        out.update({
            "ttft_p50_s": round(ttft[len(ttft) // 2], 4), "ttft_max_s": round(ttft[-1], 4),
            "cached_tokens": [r.usage.cached_tokens for r in results],
            "prompt_tokens": [r.usage.prompt_tokens for r in results],
            "outputs": [r.token_ids for r in results],
            "disk_hit_tokens": mem.get("kv_disk_hit_tokens", 0),
            "read_rate_Bps": disk.read_rate if disk is not None else None,
            "prefill_rate_tok_s": eng._scheduler._prefill_rate,
            "kv_bytes_per_token": eng._scheduler.kv.kv_bytes_per_token,
        })
    finally:
        t0 = time.perf_counter()
        eng.shutdown(timeout=60)
        out["shutdown_s"] = round(time.perf_counter() - t0, 3)
    print("RESULT " + json.dumps(out))


def _spawn(mode: str, model: str, backend: str, kv_dir: str, **args) -> dict:
    env = {**os.environ, "PARALLM_KV_DISK_DIR": kv_dir}
    env.pop("PARALLM_KV_DISK", None)
    proc = subprocess.run([sys.executable, "-m", "parallm_bench.restart", mode, model, backend, json.dumps(args)],
                          capture_output=True, text=True, env=env, timeout=1800)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"restart workload child failed: {proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def run_restart(engine, sizes=FULL_RESTART, tick=None) -> dict:
    tick = tick or (lambda msg: None)
    system_tokens, calls, new_tokens, lengths = sizes
    model, backend = str(engine.model_info.source), engine.backend.name
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="parallm-restart-") as kv_dir:
        tick("restart: the script, first process")
        first = _spawn("script", model, backend, kv_dir, system_tokens=system_tokens, calls=calls,
                       new_tokens=new_tokens)
        tick("restart: the script, second process")
        second = _spawn("script", model, backend, kv_dir, system_tokens=system_tokens, calls=calls,
                        new_tokens=new_tokens)
    out["script"] = {
        "system_tokens": system_tokens, "calls": calls,
        "first": {k: v for k, v in first.items() if k != "outputs"},
        "second": {k: v for k, v in second.items() if k != "outputs"},
        "same_outputs": first["outputs"] == second["outputs"],
        "ttft_p50_ratio": round(first["ttft_p50_s"] / max(second["ttft_p50_s"], 1e-6), 2),
    }
    rows = []
    for n in lengths:
        with tempfile.TemporaryDirectory(prefix="parallm-restart-") as kv_dir:
            tick(f"restart: {n} tokens computed")
            cold = _spawn("length", model, backend, kv_dir, tokens=n)
            tick(f"restart: {n} tokens read back")
            warm = _spawn("length", model, backend, kv_dir, tokens=n)
            again = _spawn("length", model, backend, kv_dir, tokens=n, kv_disk=0)
        faster = "restore" if warm["ttft_p50_s"] < again["ttft_p50_s"] else "recompute"
        hit = warm["disk_hit_tokens"]
        # The engine's rule with this machine's rates: the read rate the restoring process measured, the
        # prefill rate the recomputing one measured over the same tokens.
        rule_reads = reading_is_faster(hit, hit * warm["kv_bytes_per_token"], warm["read_rate_Bps"],
                                       again["prefill_rate_tok_s"]) if hit else None
        rows.append({
            "tokens": n, "blocks_tokens": warm["disk_hit_tokens"],
            "recompute_ttft_s": again["ttft_p50_s"], "restore_ttft_s": warm["ttft_p50_s"],
            "first_ttft_s": cold["ttft_p50_s"], "read_rate_MBps": round((warm["read_rate_Bps"] or 0) / 1e6, 1),
            "prefill_rate_tok_s": round(again["prefill_rate_tok_s"] or 0, 1),
            "rule_reads": rule_reads, "faster": faster,
            "rule_right": (rule_reads == (faster == "restore")) if hit else None,
            "same_outputs": cold["outputs"] == warm["outputs"] == again["outputs"],
        })
    out["lengths"] = rows
    return out


def format_lines(r: dict) -> list[str]:
    s = r["script"]
    lines = [f"restart: a script with a {s['system_tokens']}-token system prompt and {s['calls']} parallel calls, "
             f"run twice in two processes (model load excluded)",
             f"  first : TTFT p50 {s['first']['ttft_p50_s']:.3f} s, max {s['first']['ttft_max_s']:.3f} s; "
             f"cached tokens {s['first']['cached_tokens']}",
             f"  second: TTFT p50 {s['second']['ttft_p50_s']:.3f} s, max {s['second']['ttft_max_s']:.3f} s; "
             f"cached tokens {s['second']['cached_tokens']} (read from disk: {s['second']['disk_hit_tokens']})",
             f"  TTFT p50 first / second: {s['ttft_p50_ratio']}x; same outputs: {s['same_outputs']}"]
    for row in r["lengths"]:
        rule = "computes" if not row["blocks_tokens"] else ("reads" if row["rule_reads"] else "computes")
        lines.append(f"  {row['tokens']:>5} tokens: recompute TTFT {row['recompute_ttft_s']:.3f} s, restore "
                     f"{row['restore_ttft_s']:.3f} s ({row['blocks_tokens']} tokens from disk at "
                     f"{row['read_rate_MBps']} MB/s; prefill {row['prefill_rate_tok_s']} tok/s): faster "
                     f"{row['faster']}, the rule {rule}" + ("" if row["rule_right"] in (True, None) else " (WRONG)")
                     + f"; same outputs: {row['same_outputs']}")
    return lines


if __name__ == "__main__":
    child(sys.argv[1:])
