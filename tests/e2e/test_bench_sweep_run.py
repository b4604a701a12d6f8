"""`foveal bench sweep` end to end on tiny-qwen2-vl (random weights: accuracy
is ~0, the structure and the visual-token dials are what is checked)."""
from __future__ import annotations

import json
import sys

import pytest

from foveal.bench.sweep import IMAGE_TASKS
from foveal.entrypoints.cli import main


@pytest.fixture(scope="module")
def sweep_run(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_sweep")
    argv = ["bench", "sweep", "--model", tiny_checkpoints("tiny-qwen2-vl"),
            "--num-per-task", "1", "--series", "resolution,frames",
            "--max-pixels", "50176,12544,3136", "--max-tokens", "2",
            "--max-model-len", "1024", "--kv-cache-memory-bytes", str(8 << 20),
            "--output", str(out / "sweep.json"), "--plot", str(out / "sweep.png")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["foveal", *argv])  # what the report records
        assert main(argv) == 0
    return json.loads((out / "sweep.json").read_text()), out


def test_sweep_writes_every_point_of_the_asked_series_and_the_plot(sweep_run):
    report, out = sweep_run
    assert report["series"] == ["resolution", "frames"]
    assert [(p["series"], p["label"]) for p in report["points"]] == [
        ("resolution", "full"), ("resolution", "50176"), ("resolution", "12544"),
        ("resolution", "3136"), ("frames", "8"), ("frames", "4"), ("frames", "2"),
        ("frames", "1")]
    assert report["machine"]["cpu_model"]
    assert report["command_line"].startswith("foveal bench sweep --model")
    assert report["engine_kwargs"]["enable_prefix_caching"] is False
    assert (out / "sweep.png").stat().st_size > 10_000


def test_sweep_points_report_accuracy_per_applicable_task(sweep_run):
    report, _ = sweep_run
    for point in report["points"]:
        tasks = IMAGE_TASKS if point["series"] == "resolution" else ("motion",)
        assert set(point["task_accuracy"]) == set(tasks)
        assert point["num_samples"] == len(tasks)
        assert 0.0 <= point["accuracy"] <= 1.0
        assert all(0.0 <= value <= 1.0 for value in point["task_accuracy"].values())
        assert point["ttft_median_s"] > 0 and point["visual_tokens"] > 0


def test_fewer_pixels_and_frames_mean_fewer_visual_tokens(sweep_run):
    report, _ = sweep_run
    resolution = [p["visual_tokens"] for p in report["points"] if p["series"] == "resolution"]
    frames = {p["label"]: p for p in report["points"] if p["series"] == "frames"}
    assert resolution == sorted(resolution, reverse=True) and resolution[-1] < resolution[0]
    tokens = {label: point["visual_tokens"] for label, point in frames.items()}
    assert tokens["1"] < tokens["4"] < tokens["8"]
    assert [frames[label]["frames"] for label in ("8", "4", "2", "1")] == [8, 4, 2, 1]


def test_a_bad_engine_option_fails_before_any_point_runs(tiny_checkpoints, capsys):
    code = main(["bench", "sweep", "--model", tiny_checkpoints("tiny-qwen2-vl"),
                 "--num-per-task", "1", "--series", "detail,kv_cache", "--kv-dtypes", "auto,int7"])
    captured = capsys.readouterr()
    assert code == 2 and "kv_cache_dtype='int7'" in captured.err
    assert "detail low" not in captured.out
