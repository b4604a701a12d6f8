"""`foveal bench video`: the seeded test clip, the grid flags, and a tiny end-to-end run."""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

from foveal.bench.clip import ClipSpec, clip_frames, write_clip
from foveal.bench.video import _measure, _prompt, parse_fps_list, parse_pixels_list
from foveal.entrypoints.cli import main
from foveal.errors import ConfigError, FovealError
from foveal.multimodal.media.video import VideoSampling, load_video, probe_video

SMALL_CLIP = ClipSpec(seconds=2.0, width=96, height=64, fps=12, seed=3)
POINT_KEYS = {"fps", "max_pixels", "frames", "visual_tokens", "prompt_tokens", "ttft_s",
              "decode_tok_s", "e2e_s", "preprocess_s", "ttft_runs_s"}


def decoded_hash(path) -> str:
    sampling = VideoSampling(fps=12.0, max_frames=64)
    info = probe_video(str(path), sampling, 10 ** 9)
    return load_video(str(path), info, info.num_frames, sampling).content_hash


def test_clip_frames_are_deterministic_per_seed_and_move():
    first, again = list(clip_frames(SMALL_CLIP)), list(clip_frames(SMALL_CLIP))
    other_seed = list(clip_frames(ClipSpec(2.0, 96, 64, 12, seed=4)))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[0], other_seed[0])
    assert all(not np.array_equal(a, b) for a, b in zip(first, first[1:]))


def test_written_clip_has_the_asked_duration_fps_and_size(tmp_path):
    spec = ClipSpec(seconds=3.0, width=160, height=96, fps=8, seed=0)
    info = probe_video(str(write_clip(spec, tmp_path / "c.mp4")), VideoSampling(), 10 ** 9)
    assert (info.num_frames, info.fps, info.width, info.height) == (24, 8.0, 160, 96)
    assert info.duration == pytest.approx(3.0)


def test_written_clip_decodes_to_the_same_frames_every_time(tmp_path):
    first = decoded_hash(write_clip(SMALL_CLIP, tmp_path / "a.mp4"))
    again = decoded_hash(write_clip(SMALL_CLIP, tmp_path / "b.mp4"))
    other = decoded_hash(write_clip(ClipSpec(2.0, 96, 64, 12, seed=4), tmp_path / "c.mp4"))
    assert first == again != other


@pytest.mark.parametrize("width,height", [(95, 64), (96, 63), (0, 64)])
def test_clip_spec_rejects_sides_yuv420p_cannot_hold(width, height):
    with pytest.raises(ConfigError, match="even sides"):
        ClipSpec(width=width, height=height)


def test_grid_parser_reads_comma_lists_in_order_without_repeats():
    assert parse_fps_list("0.5, 1,2,1") == (0.5, 1.0, 2.0)
    assert parse_pixels_list("100352,50176") == (100352, 50176)


@pytest.mark.parametrize("parse,value", [
    (parse_fps_list, ""), (parse_fps_list, "0,1"), (parse_fps_list, "-1"), (parse_fps_list, "fast"),
    (parse_pixels_list, "1.5"), (parse_pixels_list, "50176,0"), (parse_pixels_list, ","),
])
def test_grid_parser_rejects_empty_non_positive_and_non_numeric_lists(parse, value):
    with pytest.raises(argparse.ArgumentTypeError):
        parse(value)


@pytest.fixture(scope="module")
def tiny_run(tiny_checkpoints, tmp_path_factory):
    """Three points (fps 0.5, 1, 2) x two repeats on tiny-qwen2-vl, JSON and plot written."""
    out = tmp_path_factory.mktemp("bench_video")
    code = main(["bench", "video", "--model", tiny_checkpoints("tiny-qwen2-vl"),
                 "--clip-seconds", "4", "--clip-size", "64x48", "--clip-fps", "8",
                 "--fps", "0.5,1,2", "--max-pixels", "12544", "--output-len", "3", "--repeats", "2",
                 "--max-model-len", "2048", "--json", str(out / "r.json"),
                 "--plot", str(out / "r.png")])
    assert code == 0
    return out


def test_more_sampling_fps_gives_more_frames_and_visual_tokens(tiny_run):
    low, _, high = json.loads((tiny_run / "r.json").read_text())["points"]
    assert (low["fps"], high["fps"]) == (0.5, 2.0)
    assert (low["frames"], high["frames"]) == (4, 8)
    assert high["visual_tokens"] > low["visual_tokens"] > 0


def test_points_sampling_the_same_frames_still_run_cold(tiny_run):
    """fps 0.5 and 1 both clamp to the 4-frame minimum on a 4 s clip; the run fails
    on any encoder-cache hit, so finishing means each request had its own clip."""
    low, middle, _ = json.loads((tiny_run / "r.json").read_text())["points"]
    assert (low["frames"], low["visual_tokens"]) == (middle["frames"], middle["visual_tokens"])


def test_json_report_has_one_point_per_grid_cell_with_every_measure(tiny_run):
    report = json.loads((tiny_run / "r.json").read_text())
    assert report["clip"] == {"seconds": 4.0, "width": 64, "height": 48, "fps": 8, "seed": 0}
    assert report["engine_kwargs"]["enable_prefix_caching"] is False
    assert [(p["fps"], p["max_pixels"]) for p in report["points"]] == [
        (0.5, 12544), (1.0, 12544), (2.0, 12544)]
    for point in report["points"]:
        assert set(point) == POINT_KEYS
        assert len(point["ttft_runs_s"]) == 2 and point["ttft_s"] > 0 and point["e2e_s"] > 0


def test_plot_flag_writes_a_png(tiny_run):
    data = (tiny_run / "r.png").read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


class CachedAnswerLLM:
    """Answers every request in full, but its encoder-cache hit counter moves."""

    def __init__(self) -> None:
        self.hits = 0

    def get_metrics(self) -> dict:
        return {"foveal:encoder_cache_hits_total": self.hits}

    def generate(self, prompts, params, use_tqdm=False):
        self.hits += 1
        now = time.time()
        metrics = SimpleNamespace(arrival_time=now, first_token_time=now, last_token_time=now)
        plan = [SimpleNamespace(num_frames=4, num_tokens=8)]
        return [SimpleNamespace(error=None, num_cached_tokens=0, metrics=metrics, mm_plan=plan,
                                prompt_token_ids=[1, 2],
                                outputs=[SimpleNamespace(token_ids=[0] * params.max_tokens)])]


def test_a_request_served_from_the_encoder_cache_is_rejected(tmp_path):
    prompt = _prompt([9, 13, 10], tmp_path / "c.mp4", 2.0, 12544)
    with pytest.raises(FovealError, match="served from a cache"):
        _measure(CachedAnswerLLM(), prompt, 2)
