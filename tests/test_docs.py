"""The documentation: the mkdocs site builds strictly (every page in the nav, every link and anchor
resolves), offline, and README.md's relative links point at files that exist."""

from __future__ import annotations

import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# [text](target) outside code: a relative target is a path in the repository (an anchor may follow).
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def test_docs_site_builds_strictly(tmp_path):
    """`mkdocs build --strict` fails on any warning: a broken link or anchor, a page missing from the nav
    (validation in mkdocs.yml), a nav entry without its page. The theme loads no web fonts and no plugin
    fetches anything, so this runs offline."""
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's banner about its successor
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "index.html").is_file()
    assert (site / "getting-started" / "index.html").is_file()
    assert "fonts.googleapis.com" not in (site / "index.html").read_text()


def test_readme_relative_links_exist():
    text = _FENCE.sub("", (ROOT / "README.md").read_text())
    targets = [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert targets, "README.md links to no file of the repository"
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


@pytest.mark.parametrize("command", ["./scripts/demo", "./scripts/test"])
def test_readme_set_up_commands_exist(command):
    """The README's two set-up commands are the scripts in this checkout."""
    readme = (ROOT / "README.md").read_text()
    assert f"\n{command} " in readme
    assert (ROOT / command).is_file()
