"""Gemma 3 through Foveal's LLM equals transformers, greedy tokens and
logprobs, on a tiny checkpoint (sliding window 16, 16 tokens per view): a
mixed batch with a step budget that would cut through images, multi-image
and pan-and-scan prompts, prefix- and encoder-cache hits on a repeated image,
n-gram speculation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Gemma3ForConditionalGeneration
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from foveal import LLM, SamplingParams

MAX_TOKENS = 6
IMAGE_TOKEN = 12
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _user(text: str, images=()) -> list[dict]:
    parts = [{"type": "image_pil", "image_pil": image} for image in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


CONVERSATIONS = [
    _user("Hello there, how are you?"),
    _user("Describe this picture in detail.", [_image(150, 120, 1)]),
    _user("Compare the two images, which one is brighter?", [_image(90, 200, 2), _image(64, 64, 3)]),
    _user("Write a short poem about the sea and the wind and the rain in the morning."),
]
WIDE = _user("What is written on the sign?", [_image(330, 100, 4)])


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-gemma3")


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _llm(checkpoint: str, **options) -> LLM:
    # 24-token steps: most steps would end inside a 16-token image run without the rule
    options = {"kv_cache_memory_bytes": 4 << 20, **options}
    return LLM(model=checkpoint, max_model_len=400, max_num_batched_tokens=24, max_num_seqs=8,
               block_size=4, **options)


@torch.inference_mode()
def _hf_greedy(model, prompt_ids: list[int], images: list[Image.Image], pan_and_scan: bool,
               steps: int = MAX_TOKENS) -> tuple[list[int], list[float]]:
    """A full transformers forward over the whole sequence at each step."""
    mm = {}
    if images:
        processor = Gemma3ImageProcessorPil(size={"height": 112, "width": 112}, image_mean=[0.5] * 3,
                                           image_std=[0.5] * 3, resample=2)
        kwargs = {**PAN_AND_SCAN, "pan_and_scan_max_num_crops": 4,
                  "pan_and_scan_min_ratio_to_activate": 1.2} if pan_and_scan else {}
        mm = {"pixel_values": processor(images=images, return_tensors="pt", **kwargs)["pixel_values"]}
    ids, tokens, logprobs = list(prompt_ids), [], []
    for _ in range(steps):
        input_ids = torch.tensor([ids])
        logits = model(input_ids=input_ids, token_type_ids=(input_ids == IMAGE_TOKEN).long(),
                       **mm).logits[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return tokens, logprobs


def _check(hf_model, conversation: list[dict], output, pan_and_scan: bool = False) -> None:
    images = [part["image_pil"] for part in conversation[0]["content"] if part["type"] == "image_pil"]
    tokens, logprobs = _hf_greedy(hf_model, output.prompt_token_ids, images, pan_and_scan)
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens
    ours = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
    np.testing.assert_allclose(ours, logprobs, atol=2e-4, rtol=0)


PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)


def test_mixed_batch_and_cache_hits_match_transformers(checkpoint, hf_model):
    llm = _llm(checkpoint)
    outputs = llm.chat(CONVERSATIONS, PARAMS, use_tqdm=False)
    for conversation, output in zip(CONVERSATIONS, outputs):
        _check(hf_model, conversation, output)
    assert outputs[2].prompt_token_ids.count(IMAGE_TOKEN) == 32
    again = llm.chat([CONVERSATIONS[2]], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens > 50  # prefix-cache hit through both images
    assert again.outputs[0].token_ids == outputs[2].outputs[0].token_ids
    _check(hf_model, CONVERSATIONS[2], again)
    before = llm.get_metrics()["foveal:encoder_cache_hits_total"]
    first_image = CONVERSATIONS[2][0]["content"][0]["image_pil"]
    other = [{"role": "user", "content": [{"type": "text", "text": "Tell me more about"},
                                          {"type": "image_pil", "image_pil": first_image}]}]
    output = llm.chat([other], PARAMS, use_tqdm=False)[0]  # new text first: no prefix hit
    assert llm.get_metrics()["foveal:encoder_cache_hits_total"] == before + 1
    _check(hf_model, other, output)


def test_pan_and_scan_prompt_matches_transformers(checkpoint, hf_model):
    llm = _llm(checkpoint)
    output = llm.chat([WIDE], PARAMS, use_tqdm=False, mm_processor_kwargs=PAN_AND_SCAN)[0]
    assert output.prompt_token_ids.count(IMAGE_TOKEN) == 16 * 4  # the image and 3 crops
    _check(hf_model, WIDE, output, pan_and_scan=True)
    budget = llm.chat([WIDE], PARAMS, use_tqdm=False,
                      mm_processor_kwargs={**PAN_AND_SCAN, "max_visual_tokens": 40})[0]
    assert budget.prompt_token_ids.count(IMAGE_TOKEN) == 16  # the planner dropped the crops


def test_ngram_speculation_keeps_greedy_parity(checkpoint, hf_model):
    llm = _llm(checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    outputs = llm.chat(CONVERSATIONS[1:3], PARAMS, use_tqdm=False)
    for conversation, output in zip(CONVERSATIONS[1:3], outputs):
        _check(hf_model, conversation, output)


def test_tensor_parallel_keeps_greedy_parity(checkpoint, hf_model):
    llm = _llm(checkpoint, tensor_parallel_size=2)
    output = llm.chat([CONVERSATIONS[1]], PARAMS, use_tqdm=False)[0]
    _check(hf_model, CONVERSATIONS[1], output)


LONG = _user("Tell me everything about this picture, " * 12, [_image(120, 150, 5)])


def _peak_blocks_held(llm: LLM, conversations, params, **kwargs):
    """Outputs, and the most blocks the requests held after any step's allocation."""
    scheduler = llm.llm_engine.core.scheduler
    schedule, peak = scheduler.schedule, [0]

    def tracked():
        plan = schedule()
        peak[0] = max(peak[0], scheduler.kv.num_usable_blocks - scheduler.kv.num_free_blocks)
        return plan

    scheduler.schedule = tracked
    try:
        return llm.chat(conversations, params, use_tqdm=False, **kwargs), peak[0]
    finally:
        scheduler.schedule = schedule


def test_sliding_layers_free_blocks_behind_the_window(checkpoint, hf_model):
    """Sliding layers keep their own blocks and give back those behind the window:
    the same answers as transformers, with and without, in fewer blocks."""
    hybrid = _llm(checkpoint)
    groups = hybrid.llm_engine.core.scheduler.kv.groups
    assert groups.windows == (None, 16) and groups.layers == ((1, 3), (0, 2))
    outputs, hybrid_peak = _peak_blocks_held(hybrid, [LONG, CONVERSATIONS[1]], PARAMS)
    assert len(outputs[0].prompt_token_ids) > 150  # far past the 16-token window
    for conversation, output in zip([LONG, CONVERSATIONS[1]], outputs):
        _check(hf_model, conversation, output)
    plain = _llm(checkpoint, disable_hybrid_kv_cache_manager=True)
    assert not plain.llm_engine.core.scheduler.kv.groups.is_hybrid
    plain_outputs, plain_peak = _peak_blocks_held(plain, [LONG, CONVERSATIONS[1]], PARAMS)
    for output, plain_output in zip(outputs, plain_outputs):
        assert plain_output.outputs[0].token_ids == output.outputs[0].token_ids
    # a block holds 2 layers either way (plain: 4 layers in half as many blocks)
    assert hybrid_peak * 2 < plain_peak * 4 * 0.75
    again = hybrid.chat([LONG], PARAMS, use_tqdm=False)[0]  # hits on the last window
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 4
    _check(hf_model, LONG, again)


def test_sliding_groups_with_preemption_and_int8_kv(checkpoint, hf_model):
    """A pool too small for the batch preempts and recomputes; quantized KV
    blocks carry their scales in every group. Answers equal the run without
    groups (int8 KV: the same quantized values either way)."""
    conversations = [LONG, *CONVERSATIONS]
    # 576-byte pages (2 layers of int8 blocks + scales): 128 pages, one request's worth
    small = dict(kv_cache_memory_bytes=128 * 576, kv_cache_dtype="int8")
    hybrid = _llm(checkpoint, **small)
    outputs = hybrid.chat(conversations, PARAMS, use_tqdm=False)
    assert hybrid.get_metrics()["foveal:num_preemptions_total"] > 0
    plain = _llm(checkpoint, disable_hybrid_kv_cache_manager=True, **{**small,
                 "kv_cache_memory_bytes": 8 << 20})
    for output, plain_output in zip(outputs, plain.chat(conversations, PARAMS, use_tqdm=False)):
        assert output.outputs[0].token_ids == plain_output.outputs[0].token_ids
        np.testing.assert_allclose([s[t].logprob for s, t in zip(output.outputs[0].logprobs,
                                                                 output.outputs[0].token_ids)],
                                   [s[t].logprob for s, t in zip(plain_output.outputs[0].logprobs,
                                                                 plain_output.outputs[0].token_ids)],
                                   atol=1e-5, rtol=0)


def test_prefill_and_decode_workers_move_each_groups_blocks(checkpoint):
    """A prefill engine exports each group's blocks (a sliding group's last window
    live, the rest the null block's zeros); a decode engine writes the blocks its next
    token reads and continues: one mixed engine's tokens, on a prompt far past the
    window. Engines with and without groups refuse each other's layout."""
    from foveal.disagg.exchange import layout_signature
    from foveal.executor import build_engine_core
    from tests.e2e.test_disagg_engine import engine_config, make_request, prefill_then_decode, run

    config = engine_config(checkpoint, block_size=4)
    tokenizer_text = _llm(checkpoint).get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": LONG[0]["content"][1]["text"]},
                                      {"type": "image"}]}], add_generation_prompt=True)
    prompt = {"prompt": tokenizer_text, "multi_modal_data": {"image": _image(120, 150, 5)}}
    expected = run(build_engine_core(config), [make_request(config, "m", prompt)])["m"][0]
    prefill, decode = build_engine_core(config), build_engine_core(config)
    assert prefill.scheduler.kv.groups.is_hybrid
    assert prefill_then_decode(prefill, decode, config, prompt, "d") == expected
    assert decode.get_stats()["foveal:kv_imported_tokens_total"] > 150
    plain = engine_config(checkpoint, block_size=4, disable_hybrid_kv_cache_manager=True)
    assert layout_signature(plain) != layout_signature(config)


def test_offload_tier_brings_back_each_groups_blocks(checkpoint, hf_model):
    """A pool too small to keep a finished chat's blocks: the RAM tier keeps each
    group's (the sliding groups' under their own keys), and the chat asked again
    loads them back: a prefix hit past the window, the same answer."""
    llm = _llm(checkpoint, kv_offload="cpu", kv_cache_memory_bytes=128 * 2048)  # 128 pages
    assert llm.llm_engine.core.scheduler.kv.groups.is_hybrid
    first = llm.chat([LONG], PARAMS, use_tqdm=False)[0]
    for conversation in CONVERSATIONS:  # their blocks push LONG's out of the pool
        llm.chat([conversation], PARAMS, use_tqdm=False)
    again = llm.chat([LONG], PARAMS, use_tqdm=False)[0]
    metrics = llm.get_metrics()
    assert metrics["foveal:kv_offload_hits_total"] > 0
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    _check(hf_model, LONG, again)
