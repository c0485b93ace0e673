"""The engine core's layout (issue 33): the scheduler only plans. Its modules (``scheduler.py`` and the
prefill planning it takes in, ``prefill_planner.py``) run no forward, name no KV class and use no MLX
op; the model runner runs the forwards, the KV cache manager owns the KV."""

import re
from pathlib import Path

import parallm_engine

PACKAGE = Path(parallm_engine.__file__).parent / "core"
PLANNING = ["scheduler.py", "prefill_planner.py"]
FORBIDDEN = re.compile(r"model\(|RadixCache|PagedLaneKV|SequenceKV|FrozenKV|PrefillBatchKV|mx\.")


def test_the_scheduler_only_plans():
    for name in PLANNING:
        source = (PACKAGE / name).read_text()
        hits = [line for line in source.splitlines() if FORBIDDEN.search(line)]
        assert not hits, (name, hits)
        assert not re.search(r"^\s*(import mlx|from mlx)", source, re.M), name


def test_the_scheduler_is_small():
    assert len((PACKAGE / "scheduler.py").read_text().splitlines()) < 350
