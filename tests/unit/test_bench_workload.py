"""The benchmark's synthetic workload, its statistics and its table."""
from __future__ import annotations

import math

import numpy as np
import pytest

from foveal.bench.report import (RequestRecord, ThroughputResult, best_baseline, format_table,
                                 percentile, speedup)
from foveal.bench.workload import (PromptVocab, WorkloadSpec, build_workload,
                                   parse_image_size, warmup_request, workload_summary)
from foveal.errors import CheckpointError, ConfigError

VOCAB = PromptVocab(image_prompt_ids=(9, 12, 10), image_token_id=12,
                    text_token_ids=tuple(range(14, 512)))


def spec(**overrides) -> WorkloadSpec:
    fields = dict(num_prompts=20, images_per_prompt=2, image_size=(64, 48), input_len=16,
                  output_len=40, output_len_range=0.5, seed=3)
    return WorkloadSpec(**{**fields, **overrides})


def test_same_seed_gives_identical_workload():
    first, second = build_workload(spec(), VOCAB), build_workload(spec(), VOCAB)
    assert [r.prompt_token_ids for r in first] == [r.prompt_token_ids for r in second]
    assert [r.output_len for r in first] == [r.output_len for r in second]
    for a, b in zip(first, second):
        assert [np.asarray(im).tobytes() for im in a.images] == \
               [np.asarray(im).tobytes() for im in b.images]


def test_different_seed_gives_different_workload():
    first, second = build_workload(spec(seed=1), VOCAB), build_workload(spec(seed=2), VOCAB)
    assert [r.prompt_token_ids for r in first] != [r.prompt_token_ids for r in second]


def test_prompt_is_one_placeholder_triple_per_image_then_text():
    for request in build_workload(spec(images_per_prompt=3, input_len=5), VOCAB):
        assert request.prompt_token_ids[:9] == [9, 12, 10] * 3
        text = request.prompt_token_ids[9:]
        assert len(text) == 5
        assert all(token in VOCAB.text_token_ids for token in text)
        assert len(request.images) == 3


def test_text_tokens_never_special():
    requests = build_workload(spec(num_prompts=50, input_len=64), VOCAB)
    text = [t for r in requests for t in r.prompt_token_ids[6:]]
    assert min(text) >= 14
    assert len(set(text)) > 100  # drawn across the vocabulary, not one token


def test_output_lengths_uniform_in_range():
    requests = build_workload(spec(num_prompts=400, output_len=40, output_len_range=0.5), VOCAB)
    lengths = [r.output_len for r in requests]
    assert min(lengths) >= 20 and max(lengths) <= 60
    assert min(lengths) <= 22 and max(lengths) >= 58  # both ends are reached
    assert abs(np.mean(lengths) - 40) < 2


def test_zero_output_len_range_gives_equal_lengths():
    assert {r.output_len for r in build_workload(spec(output_len_range=0.0), VOCAB)} == {40}


def test_image_sizes_vary_within_quarter_of_requested_side():
    requests = build_workload(spec(num_prompts=100, image_size=(200, 100)), VOCAB)
    sizes = [image.size for r in requests for image in r.images]
    widths, heights = [w for w, _ in sizes], [h for _, h in sizes]
    assert 150 <= min(widths) and max(widths) <= 250
    assert 75 <= min(heights) and max(heights) <= 125
    assert len(set(sizes)) > 50
    assert all(image.mode == "RGB" for r in requests for image in r.images)


def test_images_have_random_content():
    image = build_workload(spec(num_prompts=1), VOCAB)[0].images[0]
    pixels = np.asarray(image)
    assert pixels.std() > 50  # uniform noise, not a flat color the encoder could shortcut


def test_zero_images_gives_text_only_prompts():
    request = build_workload(spec(images_per_prompt=0, input_len=7), VOCAB)[0]
    assert request.images == [] and len(request.prompt_token_ids) == 7
    assert request.to_prompt() == {"prompt_token_ids": request.prompt_token_ids,
                                   "multi_modal_data": {"image": []}}


def test_to_prompt_is_a_foveal_prompt_dict():
    request = build_workload(spec(num_prompts=1), VOCAB)[0]
    prompt = request.to_prompt()
    assert prompt["prompt_token_ids"] == request.prompt_token_ids
    assert prompt["multi_modal_data"]["image"] == request.images


@pytest.mark.parametrize("overrides", [
    {"num_prompts": 0}, {"images_per_prompt": -1}, {"image_size": (0, 10)},
    {"input_len": -1}, {"output_len": 0}, {"output_len_range": 1.0},
    {"output_len_range": -0.1}])
def test_invalid_spec_is_a_config_error(overrides):
    with pytest.raises(ConfigError):
        spec(**overrides)


def test_parse_image_size():
    assert parse_image_size("640x480") == (640, 480)
    assert parse_image_size("32X16") == (32, 16)
    for bad in ("640", "640x", "x480", "a x b", "640*480"):
        with pytest.raises(ConfigError, match="WIDTHxHEIGHT"):
            parse_image_size(bad)


def test_text_without_vocabulary_is_a_checkpoint_error():
    empty = PromptVocab((9, 12, 10), 12, text_token_ids=())
    with pytest.raises(CheckpointError):
        build_workload(spec(), empty)


def test_warmup_request_shares_no_image_with_workload():
    warmup = warmup_request(VOCAB)
    assert warmup.prompt_token_ids[:3] == [9, 12, 10] and len(warmup.images) == 1
    assert np.asarray(warmup.images[0]).std() == 0


def test_workload_summary_reports_bounds():
    summary = workload_summary(spec(image_size=(100, 40), output_len=10, output_len_range=0.2))
    assert summary["image_width_range"] == [75, 125]
    assert summary["image_height_range"] == [30, 50]
    assert summary["output_len_bounds"] == [8, 12]


def _scaffold(folder, preset: str) -> dict:
    """A checkpoint folder without weights: the preset's config.json and the tiny tokenizer."""
    import json

    from foveal.loader.presets import get_preset
    from foveal.loader.tiny_tokenizer import write_tiny_tokenizer

    config = get_preset(preset)
    write_tiny_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps(config))
    return config


def test_prompt_vocab_from_a_qwen2_vl_checkpoint(tmp_path):
    config = _scaffold(tmp_path, "tiny-qwen2-vl")
    vocab = PromptVocab.from_model_dir(tmp_path)
    assert vocab.image_prompt_ids == (config["vision_start_token_id"], config["image_token_id"],
                                      config["vision_end_token_id"])
    assert vocab.image_token_id == config["image_token_id"]
    assert not set(vocab.text_token_ids) & set(vocab.image_prompt_ids)
    assert max(vocab.text_token_ids) < config.get("text_config", config)["vocab_size"]


@pytest.mark.parametrize("preset, placeholder", [
    ("tiny-llava-next", "image_token_index"), ("tiny-smolvlm", "image_token_id"),
    ("tiny-gemma3", "boi_token_index"), ("tiny-qwen3-vl", None)])
def test_each_family_writes_its_own_image_placeholder(tmp_path, preset, placeholder):
    config = _scaffold(tmp_path, preset)
    vocab = PromptVocab.from_model_dir(tmp_path)
    if placeholder is None:  # Qwen3-VL: the Qwen-VL vision span
        assert vocab.image_prompt_ids == (config["vision_start_token_id"], config["image_token_id"],
                                          config["vision_end_token_id"])
    else:
        assert vocab.image_prompt_ids == (config[placeholder],)
    key = "image_token_index" if "image_token_index" in config else "image_token_id"
    assert vocab.image_token_id == config[key]


def test_percentile_matches_numpy_linear():
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 25, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert math.isnan(percentile([], 50))
    assert percentile([4.0], 99) == 4.0


def test_tpot_excludes_first_token_and_single_token_outputs():
    assert RequestRecord(10, 5, ttft_s=1.0, finished_s=3.0).tpot_s == pytest.approx(0.5)
    assert RequestRecord(10, 1, ttft_s=1.0, finished_s=1.0).tpot_s is None


def test_summary_rates_and_latencies():
    records = [RequestRecord(100, 10, 0.5, 1.4), RequestRecord(50, 20, 1.0, 2.9)]
    summary = ThroughputResult("foveal", 2.0, records).summary()
    assert summary["requests_per_s"] == pytest.approx(1.0)
    assert summary["output_tokens_per_s"] == pytest.approx(15.0)
    assert summary["total_tokens_per_s"] == pytest.approx(90.0)
    assert summary["ttft_median_s"] == pytest.approx(0.75)
    assert summary["tpot_median_s"] == pytest.approx(0.1)


def test_table_and_speedup_pick_best_baseline():
    rows = [ThroughputResult("foveal", 1.0, [RequestRecord(10, 30, 0.1, 0.5)]).summary(),
            ThroughputResult("hf", 3.0, [RequestRecord(10, 30, 0.1, 2.0)], batch_size=1).summary(),
            ThroughputResult("hf", 2.0, [RequestRecord(10, 30, 0.1, 1.5)], batch_size=8).summary()]
    best = best_baseline(rows)
    assert best["batch_size"] == 8
    assert speedup(rows[0], best) == pytest.approx(2.0)
    table = format_table(rows).splitlines()
    assert len(table) == 5 and "hf (batch 8)" in table[4] and table[2].startswith("foveal")
    assert best_baseline(rows[:1]) is None

