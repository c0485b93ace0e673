"""The Chrome / Perfetto trace file (core/trace_file.py): ``engine.trace(path)`` and ``parallm bench --trace``
write valid trace event JSON with the engine's steps, a rows counter and each request's queue / prefill /
decode spans on its program's track."""

from __future__ import annotations

import json

import parallm_engine  # noqa: F401  (preloads BLAS before mlx)

from .model_zoo import prompt_ids


def _check_format(doc: dict) -> list[dict]:
    """The trace event format's rules the viewers rely on; returns the events."""
    events = doc["traceEvents"]
    assert doc["displayTimeUnit"] == "ms" and events
    for e in events:
        assert e["ph"] in {"X", "C", "M", "i"} and isinstance(e["pid"], int) and isinstance(e["name"], str), e
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["tid"], int), e
        if e["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in e["args"].values()), e
        if e["ph"] == "M":
            assert e["name"] in {"process_name", "thread_name"} and e["args"]["name"], e
    return events


def test_engine_trace_writes_steps_rows_and_request_phases(tiny_engine, tmp_path):
    vocab = tiny_engine.model_info.vocab_size
    path = tmp_path / "run.json"
    with tiny_engine.trace(path):
        handles = [tiny_engine.submit(prompt_ids(20, vocab, seed=i), max_tokens=5, ignore_eos=True, temperature=0,
                                      session="planner" if i < 2 else None) for i in range(4)]
        for h in handles:
            tiny_engine._collect(h)
        tiny_engine.run_on_engine_thread(lambda: None)  # the last step has ended
    events = _check_format(json.loads(path.read_text()))
    steps = [e for e in events if e.get("cat") == "step"]
    assert steps and {e["name"] for e in steps} <= {"prefill", "decode", "prefill+decode"}
    assert sum(e["args"]["decode_rows"] for e in steps) >= 4 * 5
    assert sum(e["args"]["prefill_tokens"] for e in steps) > 0
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == len(steps) and max(e["args"]["decode_rows"] for e in counters) > 1
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    by_name = {n: pid for pid, n in names}
    assert {"engine", "program planner", "requests"} <= set(by_name)
    for h in handles:
        track = [e for e in events if e["ph"] == "M" and e["args"]["name"] == h.id]
        assert len(track) == 1
        pid, tid = track[0]["pid"], track[0]["tid"]
        assert pid == by_name["program planner" if h.request.session else "requests"]
        spans = {e["name"]: e for e in events if e["ph"] == "X" and (e["pid"], e["tid"]) == (pid, tid)}
        assert {f"request {h.id}", "prefill", "decode"} <= set(spans)
        whole = spans[f"request {h.id}"]
        assert whole["args"]["output_tokens"] == 5 and whole["args"]["finish_reason"] == "length"
        assert whole["args"]["prompt_tokens"] == 20
        for name in ("queue", "prefill", "decode"):  # each phase inside the call, in order
            if name in spans:
                assert whole["ts"] - 1 <= spans[name]["ts"] <= whole["ts"] + whole["dur"] + 1
        assert spans["prefill"]["ts"] + spans["prefill"]["dur"] <= spans["decode"]["ts"] + 1
    # What ran before the recording started is not in it.
    assert all(e["ts"] >= 0 for e in events if e["ph"] in "XC")


def test_a_recording_can_be_stopped_by_hand_and_only_once(tiny_engine, tmp_path):
    rec = tiny_engine.trace(tmp_path / "a.json")
    tiny_engine.generate([prompt_ids(10, tiny_engine.model_info.vocab_size, seed=1)], max_tokens=3, temperature=0)
    assert rec.stop() == str(tmp_path / "a.json")
    first = (tmp_path / "a.json").read_text()
    assert rec.stop() == str(tmp_path / "a.json") and (tmp_path / "a.json").read_text() == first
    _check_format(json.loads(first))


def test_bench_trace_flag_writes_the_run(tiny_model_dir, tmp_path, capsys):
    from parallm_bench import cli as bench
    from parallm_engine import cli

    path = tmp_path / "bench.json"
    args = cli.build_parser().parse_args(["bench", "--model", str(tiny_model_dir), "--workloads", "constrained",
                                          "--quick", "--trace", str(path)])
    assert bench.main(args) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    events = _check_format(json.loads(path.read_text()))
    assert any(e.get("cat") == "step" for e in events)
    assert sum(1 for e in events if e.get("cat") == "request") >= 8  # the workload's rows, each its own span
