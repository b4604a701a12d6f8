"""LLaVA-1.5 / NeXT / OneVision through Foveal's LLM equal transformers on tiny
checkpoints saved by transformers: greedy tokens and logprobs of a mixed batch
(text only, one image, odd aspect ratios, two images in one prompt) with
chunked prefill cutting through image ranges, then prefix-cache and
encoder-cache hits on a repeated image with the same answer."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from foveal import LLM, SamplingParams
from tests.models.hf_reference import hf_greedy
from tests.models.llava_tiny import IMAGE_TOKEN_ID, image_processor, write_checkpoint

MAX_TOKENS = 6
VARIANTS = ["llava", "llava_next", "llava_onevision"]


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _user(text: str, *images: Image.Image) -> list[dict]:
    parts = [{"type": "image_pil", "image_pil": im} for im in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def _conversations() -> list[list[dict]]:
    return [
        _user("Hello there, how are you?"),
        _user("Describe this picture.", _image(100, 30, 1)),
        _user("Compare the two images.", _image(30, 100, 2), _image(77, 61, 3)),
        _user("Tell me a story about the sea."),
        _user("What is written here?", _image(160, 90, 4)),
    ]


@pytest.fixture(scope="module", params=VARIANTS)
def setup(request, tmp_path_factory):
    import transformers

    path = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    config = transformers.AutoConfig.from_pretrained(path)
    hf = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float32).eval()
    # 11-token steps: prefill chunks end inside the image ranges (16+ tokens each).
    llm = LLM(model=str(path), max_model_len=1024, max_num_batched_tokens=11, max_num_seqs=4, block_size=8,
              kv_cache_memory_bytes=8 << 20)
    return request.param, llm, hf


def _hf_inputs(variant: str, images: list[Image.Image]) -> dict:
    if not images:
        return {}
    processor = image_processor(variant)
    # OneVision: the prompt's images as one sample, so several switch to the multi-image mode
    out = processor(images=[images] if variant == "llava_onevision" else images, return_tensors="pt")
    inputs = {"pixel_values": out["pixel_values"]}
    if variant != "llava":
        inputs["image_sizes"] = out["image_sizes"]
    if variant == "llava_onevision":
        inputs["batch_num_images"] = out["batch_num_images"]
    return inputs


def _images(conversation) -> list[Image.Image]:
    return [p["image_pil"] for p in conversation[0]["content"] if p["type"] == "image_pil"]


def test_greedy_tokens_and_logprobs_match_transformers(setup):
    variant, llm, hf = setup
    conversations = _conversations()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    for conversation, output in zip(conversations, outputs):
        images = _images(conversation)
        assert output.prompt_token_ids.count(IMAGE_TOKEN_ID) >= 16 * len(images)
        ref_tokens, ref_logprobs = hf_greedy(hf, output.prompt_token_ids, _hf_inputs(variant, images),
                                              MAX_TOKENS)
        completion = output.outputs[0]
        assert list(completion.token_ids) == ref_tokens
        ours = [step[token].logprob for step, token in zip(completion.logprobs, ref_tokens)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=2e-4, rtol=0)


def test_repeated_image_hits_prefix_and_encoder_caches(setup):
    _, llm, _ = setup
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    picture = _image(120, 50, 9)
    first = llm.chat([_user("What is this?", picture)], params, use_tqdm=False)[0]
    again = llm.chat([_user("What is this?", picture)], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= len(first.prompt_token_ids) // 8 * 8 - 8
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    moved = llm.chat([[{"role": "assistant", "content": "Ready."}, *_user("Now this?", picture)]],
                     params, use_tqdm=False)[0]
    assert (moved.encoder_cache_queries, moved.encoder_cache_hits) == (1, 1)
