"""What a new user meets first: the demo's progress bar and closing table, no transformers warning ahead of
ParaLLM's own context-length error, set-up metadata that builds without deprecation warnings, and the
README's two set-up commands."""

from __future__ import annotations

import io
import re
import tomllib
from pathlib import Path

import pytest
from rich.console import Console

from parallm_engine import ContextLengthExceededError
from parallm_bench.demo import DemoResult, RunStats, comparison, results_table, run_demo

ROOT = Path(__file__).resolve().parents[1]


def _render(renderable, width: int = 80) -> list[str]:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def test_demo_bar_reaches_what_was_generated_and_rows_compare_the_same_prompts(engine):
    bars = io.StringIO()
    result = run_demo(engine, n=4, max_tokens=32, sequential=4, bar_file=bars)
    par, seq = result.parallel, result.sequential
    # "What is the capital of France?" ends well before 32 tokens: the bar's total shrank to match.
    assert par.tokens < 4 * 32
    assert result.bar_done == result.bar_total == par.tokens
    last = [seg for seg in re.split(r"[\r\n]", bars.getvalue()) if "prompts in parallel" in seg][-1]
    assert "100%" in last and f"{par.tokens}/{par.tokens}" in last, last
    assert seq is not None and seq.prompts == par.prompts == 4
    assert "Both rows ran the same 4 prompts" in comparison(result)
    lines = _render(results_table(result, 32))
    assert max(len(line) for line in lines) <= 80
    assert any("one at a time" in line and f"{seq.tok_s:.1f}" in line for line in lines)


def test_closing_table_fits_80_columns_with_large_numbers():
    result = DemoResult(
        parallel=RunStats("parallel", 1024, 123456, 1234.5, [12.34] * 3),
        sequential=RunStats("one at a time", 4, 1234, 98.7, [0.12] * 4),
        answers=[], peak_in_flight=64, cache_hit_rate=0.5, bar_done=123456, bar_total=123456,
    )
    lines = _render(results_table(result, 4096))
    assert max(len(line) for line in lines) <= 80
    # One line per row: nothing wrapped inside a cell.
    assert any(line.lstrip("│┃ ").startswith("parallel") and "123456" in line and "1234.5" in line for line in lines)
    assert any("one at a time" in line and "1234" in line and "12.5" in line for line in lines)
    text = comparison(result)
    assert "first 4 of the same 1024 prompts" in text and "--sequential 1024" in text
    assert "x faster" in text


def test_no_transformers_length_warning_before_the_engines_error(tiny_model_dir, capfd):
    from parallm_engine import Engine

    eng = Engine(str(tiny_model_dir))  # a fresh tokenizer: transformers warns once per tokenizer
    try:
        capfd.readouterr()
        with pytest.raises(ContextLengthExceededError, match="context window is 512"):
            eng.submit("hello " * 9000, max_tokens=2)
        with pytest.raises(ContextLengthExceededError):
            eng.submit(eng.apply_chat_template([{"role": "user", "content": "hello " * 9000}]), max_tokens=2)
        out, err = capfd.readouterr()
        assert "Token indices sequence length" not in out + err
    finally:
        eng.shutdown()


@pytest.mark.parametrize("pyproject", ["pyproject.toml", "engine/pyproject.toml"])
def test_license_is_an_spdx_string(pyproject):
    data = tomllib.loads((ROOT / pyproject).read_text())
    assert data["project"]["license"] == "Apache-2.0"
    requires = " ".join(data["build-system"]["requires"])
    version = re.search(r"setuptools>=(\d+)", requires)
    assert version and int(version.group(1)) >= 77  # the first setuptools that reads the SPDX string


def test_readme_has_exactly_two_setup_commands_and_says_where_the_cli_is():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Set up and run", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]
    assert commands == ["./scripts/demo", "./scripts/test"]
    assert ".venv/bin/parallm" in section
