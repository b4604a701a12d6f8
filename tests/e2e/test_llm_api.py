"""The offline API's behaviour as a user sees it: sampling controls, stop
conditions, logprobs, prefix-cache reuse, metrics and output shape."""
from __future__ import annotations

import io
import math

import pytest
from PIL import Image

from foveal import LLM, SamplingParams

METRIC_NAMES = (
    "foveal:prompt_tokens_total", "foveal:generation_tokens_total",
    "foveal:visual_tokens_total", "foveal:encoder_items_total",
    "foveal:prefix_cache_queries_total", "foveal:prefix_cache_hits_total",
    "foveal:num_preemptions_total", "foveal:kv_cache_usage_perc",
)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(model=tiny_checkpoints("tiny-qwen2.5-vl"), max_model_len=1024,
               kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=256)


def _image_message(text: str, color: int = 90) -> list[dict]:
    buffer = io.BytesIO()
    Image.new("RGB", (84, 56), (color, 30, 200)).save(buffer, format="PNG")
    return [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": Image.open(io.BytesIO(buffer.getvalue()))},
        {"type": "text", "text": text}]}]


def test_same_seed_gives_same_tokens_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12,
                            ignore_eos=True)
    alone = llm.generate("Tell me about the sea.", params, use_tqdm=False)[0]
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate(["Other prompt first.", "Tell me about the sea.", "And another."],
                         [others, params, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_different_seeds_give_different_samples(llm):
    outputs = [llm.generate("Tell me about the sea.",
                            SamplingParams(temperature=1.5, seed=seed, max_tokens=16,
                                           ignore_eos=True), use_tqdm=False)[0]
               for seed in (1, 2)]
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids


def test_stop_string_truncates_text_and_finishes_with_stop(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate("Once upon a time", greedy, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = llm.generate("Once upon a time",
                       SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                      stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.stop_reason == stop
    assert cut.text == full[:full.index(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0]
    assert first.finish_reason == "length" and len(first.token_ids) == 8
    stop_id = first.token_ids[2]
    stopped = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=8,
                                                   ignore_eos=True, stop_token_ids=[stop_id]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == first.token_ids[:first.token_ids.index(stop_id) + 1]


def test_logprobs_hold_sampled_token_and_top_k(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token_id, step in zip(out.token_ids, out.logprobs):
        assert token_id in step and step[token_id].rank == 1  # greedy picks rank 1
        assert 3 <= len(step) <= 4
        assert all(lp.logprob <= 0 for lp in step.values())
    assert out.cumulative_logprob == pytest.approx(
        sum(step[t].logprob for t, step in zip(out.token_ids, out.logprobs)))


def test_second_turn_about_an_image_reuses_cached_prefix(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    turn1 = _image_message("What is this?", color=17)
    first = llm.chat(turn1, greedy, use_tqdm=False)[0]
    items_before = llm.get_metrics()["foveal:encoder_items_total"]
    turn2 = turn1 + [{"role": "assistant", "content": first.outputs[0].text},
                     {"role": "user", "content": "And its colour?"}]
    second = llm.chat(turn2, greedy, use_tqdm=False)[0]
    block = 16
    assert second.num_cached_tokens >= (len(first.prompt_token_ids) // block) * block
    assert llm.get_metrics()["foveal:encoder_items_total"] == items_before


def test_different_image_same_tokens_is_not_a_cache_hit(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.chat(_image_message("Same words.", color=40), greedy, use_tqdm=False)
    other = llm.chat(_image_message("Same words.", color=41), greedy, use_tqdm=False)[0]
    # Only the system-prompt text before the image may hit.
    image_start = other.prompt_token_ids.index(llm.llm_engine.config.model.image_token_id)
    assert other.num_cached_tokens <= image_start


def test_metrics_have_the_documented_names_and_sane_values(llm):
    llm.generate("count me", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    metrics = llm.get_metrics()
    for name in METRIC_NAMES:
        assert name in metrics, name
    assert metrics["foveal:generation_tokens_total"] >= 3
    assert 0.0 <= metrics["foveal:kv_cache_usage_perc"] <= 1.0


def test_request_output_has_vllm_shape_and_timestamps(llm):
    out = llm.generate({"prompt_token_ids": [20, 21, 22, 23]},
                       SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == [20, 21, 22, 23]
    assert out.finished and out.outputs[0].finish_reason == "length"
    metrics = out.metrics
    assert metrics.arrival_time <= metrics.first_token_time <= metrics.finished_time
    assert math.isfinite(metrics.finished_time)


def test_default_sampling_params_come_from_generation_config(llm, tmp_path):
    import json

    from foveal.loader.hf_config import default_sampling_overrides

    assert llm.get_default_sampling_params().temperature == 0.0  # tiny: do_sample=false
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": 2}))
    assert default_sampling_overrides(str(tmp_path)) == {"temperature": 0.7, "top_p": 0.8,
                                                         "top_k": 20}
    assert default_sampling_overrides(str(tmp_path / "missing")) == {}


def test_chat_reports_the_visual_token_plan_per_item(llm):
    low = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(448, 448), "detail": "low"}},
        {"type": "image_url", "image_url": {"url": _data_url(448, 448), "detail": "high"}},
        {"type": "text", "text": "Compare."}]}]
    out = llm.chat(low, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert [p.detail for p in out.mm_plan] == ["low", "high"]
    low_tokens, high_tokens = (p.num_tokens for p in out.mm_plan)
    assert sum(p.num_tokens for p in out.mm_plan) == out.prompt_token_ids.count(
        llm.llm_engine.config.model.image_token_id)
    assert 0.2 <= low_tokens / high_tokens <= 0.3


def _data_url(width: int, height: int) -> str:
    import base64

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 90)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
