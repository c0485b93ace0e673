"""`parallm bench --workloads curve --plot DIR`: the latency-throughput curve (TPOT vs aggregate tok/s per
concurrency) for ParaLLM on both CPU paths and mlx-lm, as a table, a CSV, an SVG and (matplotlib) a PNG."""

from __future__ import annotations

import csv
import xml.etree.ElementTree as ET

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)


def test_curve_points_for_every_system_and_concurrency(tiny_engine, tmp_path):
    from parallm_bench import bench, curve, plot

    sizes = curve.CurveSizes((1, 4), 16, 6)
    entry = curve.run_curve(tiny_engine, sizes)
    other = {"cpu-mlx": {"parallm_mlx_path"}, "cpu-native": {"parallm_native_path"}, None: set()}
    systems = {"parallm", "mlx_lm_batch"} | other[curve._other_path(tiny_engine)]  # a GPU has one path
    assert set(entry["levels"]) == {"1", "4"}
    for c, level in entry["levels"].items():
        assert set(level) == systems
        for p in level.values():
            assert p["requests"] == int(c) and p["tokens"] == int(c) * 6
            assert p["tok_s"] > 0 and p["tpot_s"] > 0
    lines = bench.format_table({"workloads": {"curve": entry}})
    assert "curve (16-token prompts, 6 new) mlx_lm_batch: 1:" in lines

    written = plot.write_plots({"workloads": {"curve": entry}}, tmp_path)
    assert {p.name for p in written} >= {"curve.csv", "curve.svg", "curve_latency_throughput.png"}
    with open(tmp_path / "curve.csv") as fh:
        rows = list(csv.DictReader(fh))
    n = len(systems)
    assert len(rows) == 2 * n and {r["system"] for r in rows} == systems
    assert [int(r["concurrency"]) for r in rows] == [1] * n + [4] * n
    svg = ET.parse(tmp_path / "curve.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert len(svg.findall(f"{ns}polyline")) == n and len(svg.findall(f"{ns}circle")) == 2 * n
    assert (tmp_path / "curve_latency_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cli_runs_the_quick_curve(tiny_model_dir, tmp_path, capsys):
    from parallm_bench import cli as bench
    from parallm_engine import cli

    args = cli.build_parser().parse_args(["bench", "--model", str(tiny_model_dir), "--workloads", "curve", "--quick",
                                          "--plot", str(tmp_path)])
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "curve (64-token prompts, 16 new) parallm: 1:" in out and f"wrote {tmp_path / 'curve.svg'}" in out


def test_without_matplotlib_the_curve_is_a_csv_and_an_svg(monkeypatch, tmp_path):
    import sys

    from parallm_bench import plot

    entry = {"prompt_len": 8, "new_tokens": 2, "levels": {
        str(c): {"parallm": {"tok_s": 10.0 * c, "tpot_s": 0.01 * c, "tpot_p95_s": 0.02 * c, "ttft_p50_s": 0.1,
                             "requests": c, "tokens": 2 * c}} for c in (1, 2)}}
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` sees when it is absent
    written = plot.write_plots({"workloads": {"curve": entry}}, tmp_path)
    assert [p.name for p in written] == ["curve.csv", "curve.svg"]
    assert "<polyline" in (tmp_path / "curve.svg").read_text()
