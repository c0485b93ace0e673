"""One line per workload of a `parallm bench --json` file: `python -m parallm_bench.summarize FILE...`
(ParaLLM and mlx-lm BatchGenerator tok/s, TTFT p50, ITL p50, peak memory, and the ratios; used by
scripts/gpu_check, whose output must stay short)."""

from __future__ import annotations

import json
import sys


def lines(path: str) -> list[str]:
    data = json.load(open(path))
    env = data.get("env", {})
    out = [f"{path}: path={env.get('engine_path')} sizes={env.get('sizes', {}).get('n')}x"
           f"{env.get('sizes', {}).get('prompt_len')}/{env.get('sizes', {}).get('prefix_len')}"]
    for name, entry in data.get("workloads", {}).items():
        p, m = entry.get("parallm") or {}, entry.get("mlx_lm_batch") or {}
        r = entry.get("ratios") or {}

        def fmt(x):
            return (f"{x.get('tok_s', 0):8.1f} tok/s ttft50 {x.get('ttft_p50_s', 0):6.3f}s itl50 "
                    f"{x.get('itl_p50_s', 0) * 1e3:6.1f}ms peak {x.get('peak_mem_mb', 0):7.0f}MB") if x else "-"
        out.append(f"  {name:10} parallm {fmt(p)}")
        out.append(f"  {'':10} mlx-lm  {fmt(m)}")
        out.append(f"  {'':10} ratios {json.dumps(r)}")
    return out


if __name__ == "__main__":
    for f in sys.argv[1:]:
        try:
            print("\n".join(lines(f)))
        except (OSError, ValueError) as exc:
            print(f"{f}: {exc}")
