"""`parallm bench --workloads vision` on the tiny random VLM: the counters and the JSON shape (timings
are not asserted: shared, noisy machines). The realistic size's layout is checked without building it."""

from __future__ import annotations

from parallm_bench import bench

from parallm_bench import vision as bench_vision
from parallm_bench.vision_tiny import SIZES, _family_files


def test_vision_workload_encodes_each_image_once(tiny_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("PARALLM_SHAPES_DIR", str(tmp_path))
    ticks = []
    result = bench.run_bench(tiny_engine, ["vision"], quick=True, progress=ticks.append)
    v = result["workloads"]["vision"]
    assert (tmp_path / "vision-tiny" / ".done").exists()  # built once, reused by the next run
    assert len(ticks) == 3
    # The cold request runs the vision encoder; the 7 later ones on the same image never do; 8 submitted
    # together on a new image run it once between them.
    assert v["cold_encoder_runs"] == 1 and v["later_encoder_runs"] == 0 and v["later_requests"] == 7
    assert v["together_requests"] == 8 and v["together_encoder_runs"] == 1
    assert v["same_tokens"] is True  # the full cache hit gives the cold run's greedy tokens
    assert v["image_tokens"] == 4 and v["prompt_tokens"] > v["image_tokens"]
    assert 0 < v["later_ttft_p50_s"] <= v["later_ttft_max_s"] and v["cold_ttft_s"] > 0
    # A running stream while a new image was encoded (on the vision worker): the encoder ran, the
    # stream's gaps were measured around it.
    assert v["encode_s"] > 0 and v["stream_itl_p50_before_ms"] is not None
    assert v["stream_max_gap_during_encode_ms"] is not None
    lines = bench_vision.format_lines(v)
    assert "encoder runs 1" in lines[1] and "encoder runs 0" in lines[1]
    assert "vision (tiny random VLM" in bench.format_table(result)


def test_realistic_size_is_smolvlm_256m_layout():
    config, pre, proc = _family_files("idefics3", {"<image>": 49153}, 49157, SIZES["smolvlm-256m"])
    vision = config["vision_config"]
    assert (vision["hidden_size"], vision["num_hidden_layers"], vision["patch_size"], vision["image_size"]) == (
        768, 12, 16, 512)
    # 512 / 16 = 32 x 32 patches, pixel shuffle by 4: 64 image tokens, as SmolVLM-256M reads one image tile.
    assert config["scale_factor"] == 4 and proc["image_seq_len"] == 64
    assert pre["max_image_size"] == {"longest_edge": 512} and config["text_config"]["hidden_size"] == 576
