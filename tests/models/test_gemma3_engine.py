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
    return LLM(model=checkpoint, max_model_len=400, max_num_batched_tokens=24, max_num_seqs=8,
               block_size=4, kv_cache_memory_bytes=4 << 20, **options)


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
