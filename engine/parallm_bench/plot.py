"""`parallm bench --plot DIR`: one matplotlib PNG per workload of a bench result.

- ``llamacpp`` (and any workload with ``levels``: several concurrency levels; ``spec``'s ``batch_<N>``
  rows too): tok/s vs concurrency, one line per system (``<workload>_tok_s.png``).
- ``agents``: the TTFT CDF of every turn, one curve per system (``agents_ttft_cdf.png``).
- ``memory``: peak KV and peak RSS per system (``memory.png``).
- ``curve``: TPOT against aggregate tok/s, one line per system (``curve_latency_throughput.png``), and always
  ``curve.csv`` / ``curve.svg``, which need no matplotlib (``curve.py``).
- every other workload with ratios: a bar chart of its ratio lines (``<workload>_ratios.png``), 1.0 marked.

matplotlib is optional (``pip install matplotlib``, or the engine's ``bench`` extra); without it
:func:`write_plots` raises :class:`PlotUnavailableError` saying so. Works on a result dict or on the JSON
``parallm bench --json`` wrote: ``python -m parallm_bench.plot result.json DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from parallm_engine.errors import ParaLLMError

INSTALL_HINT = "pip install matplotlib (or pip install -e './engine[bench]')"


class PlotUnavailableError(ParaLLMError):
    """``--plot`` was asked for and matplotlib is not installed."""


def check_available() -> None:
    """Raise :class:`PlotUnavailableError` now (before a long run) when matplotlib is missing."""
    _pyplot()


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailableError(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from exc
    matplotlib.use("Agg")  # files only: no display needed (this backend choice is per process, not global state)
    import matplotlib.pyplot as plt

    return plt


def _title(result: dict, what: str) -> str:
    env = result.get("env") or {}
    shape = env.get("shape")
    model = (f"{shape['name']} shape ({shape['layers_kept']}/{shape['layers_full']} layers)" if shape
             else env.get("model", ""))
    return f"{what}\n{model}".strip()


def _levels_plot(plt, result, name, entry, out: Path) -> Path:
    levels = sorted(entry["levels"], key=int)
    systems = [s for s in entry["levels"][levels[0]] if isinstance(entry["levels"][levels[0]][s], dict)
               and "tok_s" in entry["levels"][levels[0]][s]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in systems:
        xs = [int(c) for c in levels if entry["levels"][c].get(system)]
        ys = [entry["levels"][c][system]["tok_s"] for c in levels if entry["levels"][c].get(system)]
        ax.plot(xs, ys, marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(c) for c in levels], [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tok/s (aggregate)")
    ax.set_title(_title(result, f"{name}: throughput vs concurrency"))
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(plt, fig, out / f"{name}_tok_s.png")


def _batch_levels(entry: dict) -> dict:
    """``spec``'s ``batch_<N>`` rows (plain vs n-gram tok/s at N concurrent) as ``levels``."""
    return {key[len("batch_"):]: {system: {"tok_s": row[f"{system}_tok_s"]} for system in ("plain", "ngram")
                                  if f"{system}_tok_s" in row}
            for key, row in entry.items() if key.startswith("batch_") and key[len("batch_"):].isdigit()}


def _ttft_cdf_plot(plt, result, name, entry, out: Path) -> Path | None:
    systems = [(s, v["ttfts_s"]) for s, v in entry.items() if isinstance(v, dict) and v.get("ttfts_s")]
    if not systems:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for system, ttfts in systems:
        xs = sorted(ttfts)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{system} (n={len(xs)})")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(_title(result, f"{name}: TTFT CDF"))
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(plt, fig, out / f"{name}_ttft_cdf.png")


def _memory_plot(plt, result, name, entry, out: Path) -> Path:
    systems = [s for s in ("parallm", "mlx_lm_batch") if isinstance(entry.get(s), dict)]
    fig, (kv_ax, rss_ax) = plt.subplots(1, 2, figsize=(8, 4))
    kv = [entry[s]["peak_kv_bytes"] / 2**20 for s in systems]
    kv_ax.bar(systems, kv, color=["tab:blue", "tab:orange"][: len(systems)])
    if entry.get("kv_bound_bytes"):
        kv_ax.axhline(entry["kv_bound_bytes"] / 2**20, color="k", linestyle="--", label="1.2 x ideal")
        kv_ax.legend()
    kv_ax.set_ylabel("peak KV (MiB)")
    rss_ax.bar(systems, [entry[s]["peak_rss_after_load_mb"] for s in systems], label="peak during the run",
               color="tab:purple")
    rss_ax.bar(systems, [entry[s]["rss_after_load_mb"] for s in systems], color="lightgray", label="after load")
    rss_ax.set_ylabel("process RSS (MiB)")
    rss_ax.legend(loc="lower center", fontsize=8)
    fig.suptitle(_title(result, f"{name}: fan-out memory, each system in its own process"))
    return _save(plt, fig, out / f"{name}.png")


def _ratios_plot(plt, result, name, entry, out: Path) -> Path | None:
    ratios = {k: v for k, v in (entry.get("ratios") or {}).items() if isinstance(v, (int, float))}
    if not ratios:
        return None
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(ratios) + 2), 4))
    keys = list(ratios)
    bars = ax.bar(range(len(keys)), [ratios[k] for k in keys], color="tab:blue")
    ax.bar_label(bars, labels=[f"{ratios[k]:g}x" for k in keys])
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right", fontsize=8)
    ax.margins(y=0.15)  # room for the bar labels
    ax.set_ylabel("ratio (x, as the ratio line names it)")
    ax.set_title(_title(result, f"{name}: ratios"))
    return _save(plt, fig, out / f"{name}_ratios.png")


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(result: dict, out_dir) -> list[Path]:
    """Write the PNGs for ``result`` (a bench result dict) into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    workloads = result.get("workloads") or {}
    curve = workloads.get("curve")
    curve_title = _title(result, "latency vs throughput")
    if isinstance(curve, dict) and "skipped" not in curve:
        from parallm_bench import curve as bench_curve

        written += bench_curve.write_files(curve, out, curve_title)
        if set(workloads) == {"curve"}:
            try:
                plt = _pyplot()
            except PlotUnavailableError:
                return written  # the CSV and the SVG
    plt = _pyplot()
    for name, entry in workloads.items():
        if not isinstance(entry, dict) or "skipped" in entry:
            continue
        if name == "curve":
            written.append(bench_curve.plot(plt, entry, out / "curve_latency_throughput.png", curve_title))
            continue
        if not entry.get("levels") and _batch_levels(entry):
            entry = {**entry, "levels": _batch_levels(entry)}
        if entry.get("levels"):
            written.append(_levels_plot(plt, result, name, entry, out))
        if name == "agents" or any(isinstance(v, dict) and v.get("ttfts_s") for v in entry.values()):
            written.append(_ttft_cdf_plot(plt, result, name, entry, out))
        if name == "memory" and isinstance(entry.get("parallm"), dict):
            written.append(_memory_plot(plt, result, name, entry, out))
        elif not entry.get("levels"):
            written.append(_ratios_plot(plt, result, name, entry, out))
    return [p for p in written if p is not None]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m parallm_bench.plot RESULT.json DIR", file=sys.stderr)
        return 2
    result = json.loads(Path(argv[0]).read_text())
    for path in write_plots(result, argv[1]):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
