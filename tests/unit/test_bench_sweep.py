"""`foveal bench sweep` without an engine: series, samples per point, scoring,
summaries, the table and the option checks."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from foveal.bench.sweep import (IMAGE_TASKS, SERIES, TASKS, SweepPlan, _engine_groups,
                                base_engine_kwargs, eval_samples, marked, point_sample, score,
                                summarize)
from foveal.bench.sweep_report import format_sweep_table
from foveal.demo_model.tasks import make_sample
from foveal.entrypoints.cli import build_parser, main
from foveal.errors import CheckpointError, ConfigError
from foveal.multimodal.media.video import VideoSampling

PLAN = SweepPlan(model_dir=Path("unused"))


def points_of(series: str):
    return [point for point in PLAN.points() if point.series == series]


def record(task: str, correct: bool, visual_tokens: int = 10, ttft_s: float = 0.1,
           generated: int = 3, decode_s: float = 0.5, frames: int | None = None) -> dict:
    return {"task": task, "correct": correct, "visual_tokens": visual_tokens, "ttft_s": ttft_s,
            "generated": generated, "decode_s": decode_s, "frames": frames, "text": ""}


def test_every_series_runs_by_default_in_registry_order():
    assert list(dict.fromkeys(point.series for point in PLAN.points())) == list(SERIES)


def test_resolution_points_start_at_full_then_cap_max_pixels_on_image_tasks():
    points = points_of("resolution")
    assert points[0].label == "full" and points[0].mm_processor_kwargs == {}
    assert [p.mm_processor_kwargs["max_pixels"] for p in points[1:]] == list(PLAN.max_pixels)
    assert all(p.tasks == IMAGE_TASKS and "motion" not in p.tasks for p in points)


def test_detail_frames_and_budget_points_set_what_each_request_sends():
    assert [p.detail for p in points_of("detail")] == ["low", "auto", "high"]
    assert [(p.num_frames, p.tasks) for p in points_of("frames")] == \
        [(n, ("motion",)) for n in (8, 4, 2, 1)]
    assert [p.mm_processor_kwargs for p in points_of("budget")] == \
        [{"max_visual_tokens": b} for b in PLAN.budgets]
    assert all(p.tasks == TASKS for p in points_of("budget"))


def test_engine_series_set_engine_kwargs_and_run_every_task():
    kv, spec = points_of("kv_cache"), points_of("speculative")
    assert [p.engine for p in points_of("weights")] == [{"quantization": None},
                                                         {"quantization": "int8"}]
    assert [p.engine for p in kv] == [{"kv_cache_dtype": d} for d in PLAN.kv_dtypes]
    assert [p.engine["speculative_config"] for p in spec] == \
        [None, {"method": "ngram", "num_speculative_tokens": 3}]
    assert all(p.tasks == TASKS for p in kv + spec)


def test_points_that_resolve_to_the_same_engine_share_one_llm():
    base = base_engine_kwargs({"kv_cache_dtype": "auto", "speculative_config": None,
                               "quantization": None})
    groups = _engine_groups(base, PLAN.points())
    # base (request-level series, kv auto, weights as stored, speculative none)
    # + KV int8 + fp8 + int4 + int8 weights + ngram
    assert len(groups) == 6
    base_kwargs, base_indices = groups[0]
    assert base_kwargs["enable_prefix_caching"] is False
    assert {PLAN.points()[i].series for i in base_indices} == set(SERIES)
    assert sorted(i for _, indices in groups for i in indices) == list(range(len(PLAN.points())))


def test_an_eagle_head_adds_a_speculative_point_with_its_own_engine():
    plan = SweepPlan(model_dir=Path("unused"), series=("speculative",), eagle_head="HEAD")
    points = plan.points()
    assert [p.label for p in points] == ["none", "ngram k=3", "eagle3 k=3"]
    assert points[2].engine["speculative_config"] == {
        "method": "eagle3", "num_speculative_tokens": 3, "model": "HEAD"}
    base = base_engine_kwargs({"kv_cache_dtype": "auto", "speculative_config": None})
    assert len(_engine_groups(base, points)) == 3


def test_series_option_picks_series_in_the_given_order():
    plan = SweepPlan(model_dir=Path("unused"), series=("frames", "detail"))
    assert [p.series for p in plan.points()] == ["frames"] * 4 + ["detail"] * 3


@pytest.mark.parametrize("kwargs,match", [
    ({"series": ("resolution", "colour")}, "unknown series"),
    ({"num_per_task": 0}, "--num-per-task must be >= 1"),
    ({"max_tokens": 0}, "--max-tokens must be >= 1"),
    ({"kv_dtypes": ()}, "--kv-dtypes is empty"),
])
def test_plan_rejects_bad_options_with_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SweepPlan(model_dir=Path("unused"), **kwargs)


def test_cli_reports_a_model_folder_without_config_json(tmp_path, capsys):
    args = build_parser().parse_args(["bench", "sweep", "--model", str(tmp_path)])
    with pytest.raises(CheckpointError, match="no config.json"):
        args.func(args)
    assert main(["bench", "sweep", "--model", str(tmp_path)]) == 2
    assert "train-demo" in capsys.readouterr().err


def test_cli_defaults_to_the_demo_model_folder():
    from foveal.bench.model_source import model_dir_from_args
    from foveal.demo_model import DEMO_MODEL_DIR

    args = build_parser().parse_args(["bench", "sweep"])
    assert model_dir_from_args(args) == DEMO_MODEL_DIR
    assert args.num_per_task == 50 and args.series == ()


def test_cli_turns_unknown_series_and_zero_samples_into_errors(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["bench", "sweep", "--model", str(tmp_path), "--series", "resolution,fps"]) == 2
    assert "unknown series ['fps']" in capsys.readouterr().err
    assert main(["bench", "sweep", "--model", str(tmp_path), "--num-per-task", "0"]) == 2
    assert "--num-per-task must be >= 1" in capsys.readouterr().err


def test_eval_samples_cycle_through_the_tasks():
    samples = eval_samples(2)
    assert [s.task for s in samples] == list(TASKS) * 2
    assert [s.uid for s in samples] == [f"eval-{i}" for i in range(12)]


def test_score_is_exact_match_after_stripping():
    assert score(" red\n", "red")
    assert not score("Red", "red") and not score("red.", "red") and not score("", "red")


def test_marked_copies_differ_per_salt_in_the_lowest_bits_only():
    image = Image.new("RGB", (40, 30), (200, 100, 51))
    first, second = np.asarray(marked(image, 1)), np.asarray(marked(image, 2))
    original = np.asarray(image)
    assert isinstance(marked(image, 1), Image.Image) and not np.array_equal(first, second)
    for copy in (first, second):
        changed = np.argwhere(copy != original)
        assert np.abs(copy.astype(int) - original).max() <= 1
        assert all(row == 0 and column < 8 and channel == 0 for row, column, channel in changed)
    assert (np.asarray(image) == (200, 100, 51)).all()  # the original is untouched


def test_point_sample_cuts_the_clip_evenly_and_the_sampler_keeps_every_frame():
    sample = make_sample("eval", 5)
    assert sample.task == "motion" and len(sample.video) == 8
    defaults = VideoSampling()  # the processor's fps 2, min_frames 4
    for count, indices in ((8, range(8)), (4, (0, 2, 4, 6)), (2, (0, 4)), (1, (0,))):
        point = points_of("frames")[(8, 4, 2, 1).index(count)]
        cut = point_sample(sample, point, salt=3)
        assert len(cut.video) == count
        assert cut.video_fps == pytest.approx(sample.video_fps * count / 8)
        assert all(np.array_equal(cut.video[k], sample.video[i])
                   for k, i in enumerate(indices) if k > 0)
        assert not np.array_equal(cut.video[0], sample.video[0])  # marked
        assert defaults.num_frames(len(cut.video), cut.video_fps) == count


def test_point_sample_marks_every_image_and_keeps_the_question():
    sample = make_sample("eval", 4)  # compare: two images
    sent = point_sample(sample, points_of("detail")[0], salt=7)
    assert len(sent.images) == 2 and sent.question == sample.question
    assert all(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(sent.images, sample.images))
    parts = sent.messages("low")[0]["content"]
    assert [part["image_url"]["detail"] for part in parts[:2]] == ["low", "low"]


def test_summarize_reports_accuracy_per_task_tokens_and_speed():
    point = points_of("budget")[0]
    records = [record("shapes", True, 10, ttft_s=0.1), record("shapes", False, 20, ttft_s=0.3),
               record("motion", True, 30, ttft_s=0.2, generated=1, frames=8)]
    row = summarize(point, records)
    assert row["accuracy"] == pytest.approx(2 / 3)
    assert row["task_accuracy"] == {"shapes": 0.5, "motion": 1.0}  # only tasks with samples
    assert row["visual_tokens"] == 20 and row["ttft_median_s"] == pytest.approx(0.2)
    assert row["decode_tok_s"] == pytest.approx(4 / 1.0)  # one-token outputs do not decode
    assert row["frames"] == 8 and row["num_samples"] == 3 and row["spec_decode"] is None


def test_table_has_a_column_per_task_and_dashes_where_a_point_does_not_apply():
    rows = [summarize(points_of("frames")[0], [record("motion", True)]),
            summarize(points_of("speculative")[1], [record("count", False)],
                      {"draft_tokens": 4, "accepted_tokens": 3, "acceptance_rate": 0.75})]
    header, rule, frames, spec = format_sweep_table(rows).splitlines()
    assert header.split(" | ")[4:10] == list(TASKS)
    assert rule.count("---") == len(header.split(" | "))
    assert frames.split(" | ")[4:10] == ["-", "-", "-", "-", "-", "1.00"]
    assert spec.rstrip(" |").endswith("0.75")
