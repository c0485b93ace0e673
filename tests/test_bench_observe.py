"""``parallm bench --workloads observe``: the live page watched and OpenTelemetry spans on, alternating with both
off, in one run (its own process: a tracer provider is set once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_the_observe_workload_watches_and_traces_its_on_runs(tiny_model_dir, tmp_path):
    out = tmp_path / "observe.json"
    env = {**os.environ, "PARALLM_KV_DISK": "0"}
    for name in ("PARALLM_OTEL", "OTEL_SDK_DISABLED"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-m", "parallm_engine.cli", "bench", "--model", str(tiny_model_dir),
                          "--workloads", "observe", "--quick", "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())["workloads"]["observe"]
    assert r["tracing"] is True
    for name in ("throughput", "fanout"):
        e = r[name]
        assert len(e["runs_off"]) == len(e["runs_on"]) == 3 and e["ratio"] > 0
    # Each "on" run traced every request (8 prompts a run, 3 runs a workload) and the stream was read.
    assert r["spans"] >= 2 * 3 * 8
    assert r["snapshots"] > 0
    assert "observe: the live page watched" in run.stdout
