"""The real coding agents, installed from npm, against ``parallm serve`` on the default model (SmolLM2-135M,
8,192-token context), configured as docs/coding-agents.md says:

- Codex CLI (``codex exec``, a ``wire_api = "responses"`` provider, configured by docs/coding-agents.md's toml
  block) completes a turn;
- Claude Code (``claude -p`` with ``ANTHROPIC_BASE_URL``) shows its "Prompt is too long" error: its own
  prompt (system prompt and 25 tool schemas, ~23k tokens) is far over this model's context.

The packages are installed once into ``~/.cache/parallm-test-npm`` (``PARALLM_TEST_NPM_DIR``) at the versions
below (their requests are the ones tests/agent_requests/ holds); the test is skipped only where npm is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from parallm_engine.serve.server import ServerThread

CODEX = "@openai/codex@0.171.0"
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
NPM_DIR = Path(os.environ.get("PARALLM_TEST_NPM_DIR", Path.home() / ".cache" / "parallm-test-npm"))


def _installed_version(package: str) -> str | None:
    manifest = NPM_DIR / "node_modules" / package / "package.json"
    return json.loads(manifest.read_text())["version"] if manifest.exists() else None


@pytest.fixture(scope="module")
def agents() -> Path:
    """``node_modules`` holding both CLIs (installed on first use; later runs reuse it)."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("npm / node are not installed: the coding agents' CLIs come from npm")
    wanted = [spec.rsplit("@", 1) for spec in (CODEX, CLAUDE_CODE)]
    if any(_installed_version(name) != version for name, version in wanted):
        NPM_DIR.mkdir(parents=True, exist_ok=True)
        # Claude Code's postinstall (copying its native binary into place) may be held back by npm's script
        # policy: the tests start it through its own fallback launcher, cli-wrapper.cjs, either way.
        subprocess.run([npm, "install", "--prefix", str(NPM_DIR), "--no-audit", "--no-fund", CODEX, CLAUDE_CODE],
                       check=True, capture_output=True, timeout=600)
    return NPM_DIR / "node_modules"


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine=engine) as srv:
        yield srv


def codex_config(base_url: str, context_window: int) -> str:
    """docs/coding-agents.md's Codex configuration (its toml block), for this server's model and address."""
    doc = (Path(__file__).parents[1] / "docs" / "coding-agents.md").read_text()
    block = re.search(r"```toml\n(.*?)```", doc, re.S).group(1)
    block = block.replace('model = "local"', 'model = "default"')
    block = re.sub(r"model_context_window = \d+", f"model_context_window = {context_window}", block)
    return re.sub(r'base_url = "[^"]*"', f'base_url = "{base_url}"', block)


def test_codex_exec_completes_a_turn(agents, server, engine, tmp_path):
    home = tmp_path / "codex-home"
    home.mkdir()
    # The docs' small-context options, so the turn is quick on a CPU: short instructions in place of Codex's
    # ~20 KB, no environment or collaboration-mode context (~1,650 tokens in all instead of ~5,600).
    (home / "instructions.md").write_text("You are a coding agent. Answer briefly.\n")
    small = (f'model_instructions_file = "{home / "instructions.md"}"\ninclude_environment_context = false\n'
             "include_collaboration_mode_instructions = false\n")
    (home / "config.toml").write_text(small + codex_config(server.base_url, engine.context_window))
    env = {**os.environ, "CODEX_HOME": str(home), "HOME": str(tmp_path), "NO_COLOR": "1"}
    env.pop("OPENAI_API_KEY", None)
    done = subprocess.run([str(agents / ".bin" / "codex"), "exec", "--skip-git-repo-check", "Say hello."],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "tokens used" in out and "ERROR" not in out, out[-3000:]
    assert done.stdout.strip(), out[-3000:]  # the model's answer, printed last


def test_claude_code_shows_the_context_length_error(agents, server, engine, tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_AUTH_TOKEN": "none",
           "ANTHROPIC_MODEL": "default", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "NO_COLOR": "1"}
    env.pop("ANTHROPIC_API_KEY", None)
    launcher = agents / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"
    done = subprocess.run(["node", str(launcher), "-p", "say hi"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180, stdin=subprocess.DEVNULL)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert "Prompt is too long" in out and f"limit {engine.context_window - 1}" in out, out[-3000:]
