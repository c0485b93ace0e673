"""The engine's environment variables (``parallm_engine/settings.py``): read in that one module, with one
meaning of on / off, each documented in its table."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest

from parallm_engine import settings

ROOT = Path(__file__).resolve().parents[1]
# The integrations import without the engine installed (base_url= alone): their fields read their own
# defaults (PARALLM_BASE_URL, PARALLM_API_KEY) the frameworks' way (LangChain's from_env); the table lists them.
RUNTIME = [ROOT / "engine" / "parallm_engine"]


def _runtime_files(suffixes=(".py",)):
    for top in RUNTIME:
        yield from (p for p in sorted(top.rglob("*")) if p.suffix in suffixes)


def _environment_reads(tree: ast.AST):
    """``os.environ.get("PARALLM_...")`` / ``os.environ["PARALLM_..."]`` / ``os.getenv("PARALLM_...")``."""
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            target = ast.unparse(node.func)
            name = node.args[0].value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            target = ast.unparse(node.value)
            name = node.slice.value
        if target in ("os.environ.get", "os.getenv", "os.environ", "environ.get") and isinstance(name, str) \
                and name.startswith("PARALLM_"):
            yield node.lineno, name


def test_only_the_settings_module_reads_parallm_variables():
    found = []
    for path in _runtime_files():
        if path.name == "settings.py" and path.parent.name == "parallm_engine":
            continue
        for line, name in _environment_reads(ast.parse(path.read_text())):
            found.append(f"{path.relative_to(ROOT)}:{line} {name}")
    assert not found, "read these through parallm_engine.settings:\n" + "\n".join(found)


def test_every_variable_named_in_the_runtime_is_in_the_table():
    named = set()
    for path in _runtime_files():
        named |= set(re.findall(r"\bPARALLM_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    for path in _runtime_files((".cpp",)):  # its macros are PARALLM_ too: only what it reads with getenv
        named |= set(re.findall(r'getenv\("(PARALLM_[A-Z0-9_]+)"\)', path.read_text()))
    missing = sorted(named - set(settings.VARIABLES))
    assert not missing, f"not in settings.VARIABLES: {missing}"


def test_every_variable_is_documented():
    page = (ROOT / "docs" / "getting-started.md").read_text()
    assert [name for name in settings.VARIABLES if f"`{name}`" not in page] == []


@pytest.mark.parametrize("raw,want", [("1", True), ("on", True), (" TRUE ", True), ("yes", True),
                                      ("0", False), ("off", False), ("False", False), (" no", False)])
def test_one_meaning_of_on_and_off(raw, want, monkeypatch):
    for name, default in (("PARALLM_FUSE_PREFILL", True), ("PARALLM_COMPILE_DECODE", False),
                          ("PARALLM_BATCH_INVARIANT", True), ("PARALLM_NATIVE", True)):
        monkeypatch.setenv(name, raw)
        assert settings.flag(name, default) is want


def test_unset_empty_and_unknown_values_keep_the_default(monkeypatch, caplog):
    monkeypatch.delenv("PARALLM_DECODE_WORKING_SET", raising=False)
    assert settings.decode_working_set() is True
    monkeypatch.setenv("PARALLM_DECODE_WORKING_SET", "  ")
    assert settings.decode_working_set() is True
    monkeypatch.setenv("PARALLM_DECODE_WORKING_SET", "maybe")
    with caplog.at_level(logging.WARNING, logger="parallm_engine"):
        assert settings.decode_working_set() is True
    assert "PARALLM_DECODE_WORKING_SET='maybe'" in caplog.text
    monkeypatch.setenv("PARALLM_DECODE_LANES", "two")
    assert settings.decode_lanes() is None
    monkeypatch.setenv("PARALLM_DECODE_LANES", "0")
    assert settings.decode_lanes() == 1
    monkeypatch.setenv("PARALLM_GPU_SHARED_PREFIX", "Cascade")
    assert settings.gpu_shared_prefix() == "cascade"
    monkeypatch.setenv("PARALLM_API_KEYS", "a, b,,a")
    monkeypatch.setenv("PARALLM_API_KEY", "c")
    assert settings.api_keys() == ["a", "b", "c"]
    with pytest.raises(KeyError):
        settings.text("PARALLM_NOT_A_SETTING")


def test_fuse_prefill_off_turns_it_off(monkeypatch):
    """``PARALLM_FUSE_PREFILL=off`` used to leave fusion on (only "0" was read as off)."""
    from parallm_engine.core.scheduler import SchedulerConfig

    monkeypatch.setenv("PARALLM_FUSE_PREFILL", "off")
    assert SchedulerConfig().fuse_prefill is False
    monkeypatch.setenv("PARALLM_FUSE_PREFILL", "on")
    assert SchedulerConfig().fuse_prefill is True


def test_the_step_switches_are_engine_options(tiny_model_dir, monkeypatch):
    """``fuse_prefill`` / ``compile_decode`` / ``decode_working_set`` are Engine options (the variables only their
    defaults): an explicit option wins over the variable, each reaches the part it switches, and a value that
    is not a bool is a typed error."""
    from parallm_engine import Engine
    from parallm_engine.errors import InvalidRequestError

    monkeypatch.setenv("PARALLM_FUSE_PREFILL", "on")
    monkeypatch.setenv("PARALLM_DECODE_WORKING_SET", "on")
    eng = Engine(str(tiny_model_dir), backend="cpu-mlx", decode_lanes=1, fuse_prefill=False,
                 compile_decode=True, decode_working_set=False)
    try:
        sched = eng._scheduler
        assert (eng.config.fuse_prefill, eng.config.compile_decode, eng.config.decode_working_set) == \
            (False, True, False)
        assert sched.runner.split is None  # no step fuses a prompt's chunk
        assert sched.runner.forwards.compile_steps is True
        assert all(lane.kv.ws.enabled is False for lane in sched.kv.batch.lanes)
        out = eng.generate(["one two three"], max_tokens=24, temperature=0, ignore_eos=True)[0]
        assert len(out.token_ids) == 24
        assert eng.stats()["memory"]["kv_working_set_appends"] == 0  # nothing kept, so nothing appended
    finally:
        eng.shutdown()
    with pytest.raises(InvalidRequestError) as err:
        Engine(str(tiny_model_dir), backend="cpu-mlx", fuse_prefill="off")
    assert err.value.param == "fuse_prefill"
