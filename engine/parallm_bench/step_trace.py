"""Summarise a step trace (``PARALLM_STEP_TRACE=<file>``, one JSON line per engine step):
``python -m parallm_bench.step_trace FILE [--last N] [--runs]``. Prints the decode steps' percentiles and the
slowest steps beside the median one, with what happened in them (prefill tokens, rows joined or retired,
KV bytes moved), so a latency spike can be tied to its cause."""

from __future__ import annotations

import argparse
import json


def load(path: str, last: int | None = None) -> list[dict]:
    steps = [json.loads(line) for line in open(path) if line.strip()]
    return steps[-last:] if last else steps


def runs(steps: list[dict], gap_s: float = 0.5) -> list[list[dict]]:
    """The trace cut where the engine sat idle longer than ``gap_s`` (a benchmark's separate runs)."""
    out: list[list[dict]] = []
    end = None
    for s in steps:
        if end is None or s["t"] - end > gap_s:
            out.append([])
        out[-1].append(s)
        end = s["t"] + (s["plan_ms"] + s["prefill_ms"] + s["decode_ms"]) / 1e3
    return out


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))] if v else 0.0


def summary(steps: list[dict], slowest: int = 8) -> list[str]:
    total = [s["plan_ms"] + s["prefill_ms"] + s["decode_ms"] for s in steps]
    decode = [s for s in steps if s["rows"] and not s["prefill_tokens"]]
    out = [f"{len(steps)} steps, {sum(total) / 1e3:.3f} s; {len(decode)} decode-only steps"]
    if decode:
        ms = [s["decode_ms"] for s in decode]
        wait = [s["wait_ms"] for s in decode]
        launch = [s.get("launch_ms", 0.0) for s in decode]
        out.append("decode-only step ms: p50 %.2f p90 %.2f p99 %.2f max %.2f; device wait p50 %.2f (launch p50 %.2f),"
                   " host p50 %.2f" % (_pct(ms, .5), _pct(ms, .9), _pct(ms, .99), max(ms), _pct(wait, .5),
                                       _pct(launch, .5), _pct([a - b for a, b in zip(ms, wait)], .5)))
    out.append("slowest steps (index: total ms = plan + prefill + decode [wait]; prefill tokens, rows, joined,"
               " finished, moved bytes):")
    for i in sorted(range(len(steps)), key=lambda i: -total[i])[:slowest]:
        s = steps[i]
        out.append(f"  {i:5d}: {total[i]:8.2f} = {s['plan_ms']:.2f} + {s['prefill_ms']:.2f} + {s['decode_ms']:.2f}"
                   f" [{s['wait_ms']:.2f}]; {s['prefill_tokens']}, {s['rows']}, {s['joined']}, {s['finished']},"
                   f" {s['moved_bytes']}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--last", type=int, default=None, help="only the last N steps (one run of several)")
    ap.add_argument("--slowest", type=int, default=8)
    ap.add_argument("--runs", action="store_true", help="one summary per run (cut at idle gaps over 0.5 s)")
    args = ap.parse_args(argv)
    steps = load(args.file, args.last)
    for i, run in enumerate(runs(steps) if args.runs else [steps]):
        if args.runs:
            print(f"-- run {i}")
        print("\n".join(summary(run, args.slowest)))


if __name__ == "__main__":
    main()
