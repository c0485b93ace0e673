"""``parallm bench --distributed pipeline|tensor``: one model on 1 rank and on N ranks of ``mlx.launch``.

Both are real servers (``parallm serve``; the N-rank one under ``mlx.launch -n N --backend ring``), on the
pure-MLX path the ranks run, given the same concurrent greedy chat traffic. Reported: generated tokens per
second (one stream and ``--concurrency`` at once), each rank's weight bytes against one process's, the share
of a one-stream step that communication and coordination add (on one machine the stages' compute adds up to
one rank's, so the step time's growth is that share), the communication measured by replaying the steps'
collectives alone (``distributed/comm_probe.py``), and the control messages' share of the engine's busy
time (rank 0's per-step plan). On one machine the ranks share its
cores: this is a correctness and overhead figure, not the speed-up of several machines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from parallm_bench.server_process import free_port, wait_healthy


_PIPES: list[int] = []


def _serve(model: str | None, ranks: int, mode: str) -> tuple[subprocess.Popen, str]:
    bin_dir = Path(sys.executable).parent
    port = free_port()
    cmd = [str(bin_dir / "parallm"), "serve", "--port", str(port), "--kv-disk", "0", "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    if ranks > 1:
        cmd = [str(bin_dir / "mlx.launch"), "-n", str(ranks), "--backend", "ring", "--", *cmd, "--distributed", mode]
    env = {**os.environ, "PARALLM_BACKEND": "cpu-mlx"} if sys.platform == "linux" else dict(os.environ)
    # mlx.launch forwards its stdin to the ranks in a select() loop that spins a core on an input at end of
    # file (/dev/null): it gets a pipe that stays open and never becomes readable.
    quiet, _keep_open = os.pipe()
    _PIPES.append(_keep_open)
    proc = subprocess.Popen(cmd, env=env, stdin=quiet, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    os.close(quiet)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc=proc, timeout=600)
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _load(url: str, n: int, max_tokens: int) -> dict:
    """``n`` concurrent greedy chat requests of ``max_tokens`` each: generated tokens per second."""
    with httpx.Client(timeout=1200) as client:
        model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
        bodies = [{"model": model, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                   "messages": [{"role": "user", "content": f"Tell story number {i}."}]} for i in range(n)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            out = list(pool.map(lambda b: client.post(f"{url}/v1/chat/completions", json=b).json(), bodies))
        wall = time.perf_counter() - t0
    tokens = sum(r["usage"]["completion_tokens"] for r in out)
    return {"requests": n, "tokens": tokens, "seconds": round(wall, 3), "tok_s": round(tokens / wall, 2),
            "texts": [r["choices"][0]["message"]["content"] for r in out]}


def _metric(text: str, name: str) -> dict[str, float]:
    """``name``'s samples on a /metrics page, by their label string."""
    return {m.group(1) or "": float(m.group(2))
            for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M)}


def run(model: str | None, mode: str, ranks: int, quick: bool, concurrency: int | None) -> dict:
    n = concurrency or (8 if quick else 16)
    max_tokens = 32 if quick else 64
    result = {"mode": mode, "ranks": ranks, "concurrency": n, "max_tokens": max_tokens, "runs": {}}
    for r in (1, ranks):
        proc, url = _serve(model, r, mode)
        try:
            _load(url, 1, 4)  # warm-up
            one = _load(url, 1, max_tokens)
            many = _load(url, n, max_tokens)
            page = httpx.get(f"{url}/metrics").text
            row = {"single_tok_s": one["tok_s"], "concurrent_tok_s": many["tok_s"], "texts": many["texts"]}
            if r > 1:
                row["rank_weight_bytes"] = _metric(page, "parallm_distributed_rank_weights_bytes")
                control = sum(_metric(page, "parallm_distributed_control_seconds_total").values())
                busy = sum(_metric(page, "parallm_engine_busy_seconds_total").values())
                messages = sum(_metric(page, "parallm_distributed_control_messages_total").values())
                row["control_ms_per_step"] = round(1000 * control / max(messages, 1), 3)
                row["control_share_of_busy"] = round(control / busy, 4) if busy else None
                # the steps' collectives replayed alone on probed steps (distributed/comm_probe.py)
                row["comm_ms_per_step"] = round(1000 * sum(_metric(page, "parallm_distributed_step_comm_seconds")
                                                           .values()), 3)
                row["comm_share_of_step"] = sum(_metric(page, "parallm_distributed_step_comm_share").values()) or None
            else:
                row["weight_bytes"] = sum(_metric(page, "parallm_weight_bytes").values()) or None
            result["runs"][r] = row
        finally:
            _stop(proc)
    one, many = result["runs"][1], result["runs"][ranks]
    result["same_texts"] = one.pop("texts") == many.pop("texts")
    return result


def format_result(res: dict) -> str:
    one, many = res["runs"][1], res["runs"][res["ranks"]]
    lines = [f"distributed={res['mode']} on {res['ranks']} ranks of one machine (they share its cores: a correctness "
             "and overhead figure, not a multi-machine speed-up)",
             f"{'':24}{'1 rank':>12}{str(res['ranks']) + ' ranks':>12}{'ratio':>8}"]
    for key, label in (("single_tok_s", "one stream tok/s"), ("concurrent_tok_s", f"{res['concurrency']} at once tok/s")):
        a, b = one[key], many[key]
        lines.append(f"{label:24}{a:>12.2f}{b:>12.2f}{b / a if a else 0:>8.2f}")
    weights = many.get("rank_weight_bytes") or {}
    if weights:
        ranks = {re.search(r'rank="(\d+)"', k).group(1): v for k, v in weights.items()}
        lines.append("weights per rank: " + ", ".join(f"rank {r}: {v / 2**20:.1f} MiB" for r, v in sorted(ranks.items()))
                     + (f" (one process: {one['weight_bytes'] / 2**20:.1f} MiB)" if one.get("weight_bytes") else ""))
    if one["single_tok_s"] and many["single_tok_s"]:  # one stream: one token per step
        t1, tn = 1000 / one["single_tok_s"], 1000 / many["single_tok_s"]
        lines.append(f"one stream's step: {t1:.1f} ms on 1 rank, {tn:.1f} ms on {res['ranks']}: "
                     f"{100 * max(tn - t1, 0) / tn:.0f}% of a step is communication and coordination (on one "
                     "machine the stages' compute adds up to one rank's)")
    if many.get("comm_share_of_step"):
        lines.append(f"communication, measured (the step's collectives replayed alone): {many['comm_ms_per_step']} ms "
                     f"per step, {100 * many['comm_share_of_step']:.0f}% of the step's forwards")
    lines.append(f"control message per step: {many.get('control_ms_per_step')} ms "
                 f"({100 * (many.get('control_share_of_busy') or 0):.2f}% of the engine's busy time)")
    lines.append(f"same greedy texts on 1 and {res['ranks']} ranks: {res['same_texts']}")
    return "\n".join(lines)


def main(args) -> int:
    res = run(args.model, args.distributed, getattr(args, "ranks", 2) or 2, args.quick, getattr(args, "concurrency", None))
    print(format_result(res))
    if getattr(args, "json_path", None):
        with open(args.json_path, "w") as fh:
            json.dump(res, fh, indent=2)
        print(f"wrote {args.json_path}")
    return 0 if res["same_texts"] else 1
