"""`parallm bench --workloads curve`: the latency-throughput curve engines are compared by (the MLC LLM
study's plot): at each concurrency, the aggregate generated tok/s against the time per output token (TPOT:
(latency - TTFT) / (output tokens - 1), ``_point``), for ParaLLM on both CPU paths (native, and pure MLX: what Metal
and CUDA run; on a GPU its one path) and mlx-lm's BatchGenerator, on the same prompts.

``--plot DIR`` writes ``curve.csv`` and ``curve.svg`` (drawn here, no library needed) and, with matplotlib,
``curve_latency_throughput.png``.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape


@dataclass(frozen=True)
class CurveSizes:
    concurrencies: tuple[int, ...]
    prompt_len: int
    new_tokens: int


FULL_CURVE = CurveSizes((1, 2, 4, 8, 16, 32, 64), 128, 64)
QUICK_CURVE = CurveSizes((1, 4, 16), 64, 16)
COLORS = {"parallm": "#1f77b4", "parallm_mlx_path": "#2ca02c", "parallm_native_path": "#2ca02c",
          "mlx_lm_batch": "#ff7f0e"}


def _other_path(engine) -> str | None:
    """The CPU path the bench's engine is not on (None on a GPU, which has one)."""
    if engine.backend.device != "cpu":
        return None
    return "cpu-native" if engine.backend.name == "cpu-mlx" else "cpu-mlx"


def run_curve(engine, sizes: CurveSizes = QUICK_CURVE, tick=None) -> dict:
    from parallm_bench.bench import _on_engine, _prompts, run_mlx_lm_batch, run_parallm
    from parallm_engine.core.engine import Engine

    tick = tick or (lambda msg: None)
    rng = random.Random(4321)
    vocab = engine.model_info.vocab_size
    prompts = {c: _prompts(rng, c, sizes.prompt_len, vocab) for c in sizes.concurrencies}
    levels: dict = {str(c): {} for c in sizes.concurrencies}
    for c in sizes.concurrencies:
        tick(f"curve: parallm at {c}")
        levels[str(c)]["parallm"] = _point(run_parallm(engine, prompts[c], sizes.new_tokens))
        tick(f"curve: mlx-lm BatchGenerator at {c}")
        levels[str(c)]["mlx_lm_batch"] = _point(
            _on_engine(engine, lambda: run_mlx_lm_batch(engine.model, prompts[c], sizes.new_tokens)))
    other = _other_path(engine)
    if other is not None:
        name = "parallm_mlx_path" if other == "cpu-mlx" else "parallm_native_path"
        eng = Engine(engine.model_info.source, backend=other, max_batch_size=engine.config.max_batch_size)
        try:
            eng.generate([[300, 301, 302]], max_tokens=2, temperature=0)  # warm-up
            for c in sizes.concurrencies:
                tick(f"curve: parallm ({other}) at {c}")
                levels[str(c)][name] = _point(run_parallm(eng, prompts[c], sizes.new_tokens))
        finally:
            eng.shutdown()
    return {"levels": levels, "prompt_len": sizes.prompt_len, "new_tokens": sizes.new_tokens,
            "engine_path": engine.backend.name, "other_path": other}


def _point(run: dict) -> dict:
    """A run as a point: TPOT as the MLC / vLLM studies define it, (latency - TTFT) / (output tokens - 1), from
    the run's wall time and median TTFT (the requests start together). Not the median gap between deltas: a
    loaded machine's caller reads several queued deltas at one instant, and that median fell to 0 in CI."""
    per_request = run["tokens"] / max(1, run["requests"])
    tpot = max(0.0, run["wall_s"] - run["ttft_p50_s"]) / max(1.0, per_request - 1)
    return {"tok_s": run["tok_s"], "tpot_s": round(tpot, 6), "tpot_p95_s": run["itl_p95_s"],
            "ttft_p50_s": run["ttft_p50_s"], "requests": run["requests"], "tokens": run["tokens"]}


def rows(entry: dict) -> list[dict]:
    """One row per (system, concurrency), concurrency ascending."""
    out = []
    for c in sorted(entry["levels"], key=int):
        for system, p in entry["levels"][c].items():
            out.append({"system": system, "concurrency": int(c), **p})
    return out


def format_lines(entry: dict) -> list[str]:
    by_system: dict = {}
    for r in rows(entry):
        by_system.setdefault(r["system"], []).append(f"{r['concurrency']}: {r['tok_s']:.1f} tok/s, "
                                                     f"TPOT {1e3 * r['tpot_s']:.1f} ms")
    return [f"curve ({entry['prompt_len']}-token prompts, {entry['new_tokens']} new) {system}: " + "; ".join(points)
            for system, points in by_system.items()]


def write_files(entry: dict, out: Path, title: str = "") -> list[Path]:
    """``curve.csv`` and ``curve.svg`` (no plotting library needed)."""
    out.mkdir(parents=True, exist_ok=True)
    data = rows(entry)
    csv_path = out / "curve.csv"
    with open(csv_path, "w", newline="") as fh:
        fields = ["system", "concurrency", "tok_s", "tpot_s", "tpot_p95_s", "ttft_p50_s", "requests", "tokens"]
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(data)
    svg_path = out / "curve.svg"
    svg_path.write_text(_svg(data, title))
    return [csv_path, svg_path]


def _svg(data: list[dict], title: str, width: int = 640, height: int = 420) -> str:
    """TPOT (ms, y) against aggregate tok/s (x), a polyline per system, each point labelled by its concurrency."""
    left, right, top, bottom = 70, 160, 40, 50
    xmax = max((r["tok_s"] for r in data), default=1.0) * 1.05 or 1.0
    ymax = max((1e3 * r["tpot_s"] for r in data), default=1.0) * 1.1 or 1.0
    pw, ph = width - left - right, height - top - bottom

    def xy(r):
        return left + pw * r["tok_s"] / xmax, top + ph * (1 - 1e3 * r["tpot_s"] / ymax)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="11">', f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{left}" y="20" font-size="13">{escape(title or "latency vs throughput")}</text>',
             f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="black"/>',
             f'<text x="{left + pw / 2}" y="{height - 12}" text-anchor="middle">aggregate generated tok/s</text>',
             f'<text x="16" y="{top + ph / 2}" transform="rotate(-90 16 {top + ph / 2})" text-anchor="middle">'
             f'time per output token (ms)</text>']
    for i in range(5):
        xv, yv = xmax * i / 4, ymax * i / 4
        parts.append(f'<text x="{left + pw * i / 4:.1f}" y="{top + ph + 15}" text-anchor="middle">{xv:.0f}</text>')
        parts.append(f'<text x="{left - 6}" y="{top + ph * (1 - i / 4) + 4:.1f}" text-anchor="end">{yv:.0f}</text>')
    systems = list(dict.fromkeys(r["system"] for r in data))
    for k, system in enumerate(systems):
        color = COLORS.get(system, "#7f7f7f")
        pts = [xy(r) for r in data if r["system"] == system]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                     + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
        for r in (r for r in data if r["system"] == system):
            x, y = xy(r)
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>')
            parts.append(f'<text x="{x + 5:.1f}" y="{y - 5:.1f}" fill="{color}">{r["concurrency"]}</text>')
        ly = top + 16 * k
        parts.append(f'<rect x="{left + pw + 12}" y="{ly}" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text x="{left + pw + 26}" y="{ly + 9}">{escape(system)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def plot(plt, entry: dict, path: Path, title: str) -> Path:
    """The same chart as a matplotlib PNG."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    data = rows(entry)
    for system in dict.fromkeys(r["system"] for r in data):
        mine = [r for r in data if r["system"] == system]
        xs, ys = [r["tok_s"] for r in mine], [1e3 * r["tpot_s"] for r in mine]
        ax.plot(xs, ys, marker="o", label=system, color=COLORS.get(system))
        for r, x, y in zip(mine, xs, ys):
            ax.annotate(str(r["concurrency"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("aggregate generated tok/s")
    ax.set_ylabel("time per output token (ms)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
