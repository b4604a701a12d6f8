"""Idefics3 / SmolVLM through Foveal's LLM equal transformers on tiny checkpoints
(64px tiles, 16 tokens each, longest edge 2 tiles): greedy tokens and logprobs
of a mixed batch (text only, split images of odd aspect ratios, a one-tile
image, two images in one prompt) with 11-token steps cutting through image
ranges; the expanded prompt equals transformers' prompt string; prefix- and
encoder-cache hits on a repeated image; the budget planner's fewer tiles."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from foveal import LLM, SamplingParams
from foveal.multimodal.processors.idefics3_family import TINY_MARKERS
from foveal.tokenizer import Tokenizer

MAX_TOKENS = 6
IMAGE_TOKEN = 12
SEQ_LEN = 16
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _user(text: str, *images: Image.Image) -> list[dict]:
    parts = [{"type": "image_pil", "image_pil": image} for image in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


CONVERSATIONS = [
    _user("Hello there, how are you?"),
    _user("Describe this picture.", _image(100, 30, 1)),  # 1 x 2 tiles + global
    _user("Compare the two images.", _image(30, 100, 2), _image(77, 61, 3)),  # 2 x 1, 2 x 2
    _user("Tell me a story about the sea."),
    _user("What is written here?", _image(150, 20, 4)),  # 1 x 2 tiles: a very wide image
]


@pytest.fixture(scope="module", params=["tiny-idefics3", "tiny-smolvlm"])
def setup(request, tiny_checkpoints):
    import transformers

    path = tiny_checkpoints(request.param)
    config = transformers.AutoConfig.from_pretrained(path)
    hf = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float32).eval()
    # 11-token steps: prefill chunks end inside the image ranges (16+ tokens each).
    llm = LLM(model=path, max_model_len=1024, max_num_batched_tokens=11, max_num_seqs=4, block_size=8,
              kv_cache_memory_bytes=8 << 20)
    return path, llm, hf


def _hf_processor() -> Idefics3ImageProcessorPil:
    return Idefics3ImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64},
                                     image_mean=[0.5] * 3, image_std=[0.5] * 3)


@torch.inference_mode()
def _hf_greedy(model, prompt_ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[float]]:
    """A full transformers forward per step (no KV cache): every logit from transformers alone."""
    mm = {}
    if images:
        out = _hf_processor()(images=[images], return_tensors="pt")
        mm = {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"]}
    ids, tokens, logprobs = list(prompt_ids), [], []
    for _ in range(MAX_TOKENS):
        logits = model(input_ids=torch.tensor([ids]), **mm).logits[0, -1].float()
        token = int(torch.argmax(logits))
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return tokens, logprobs


def _images(conversation) -> list[Image.Image]:
    return [p["image_pil"] for p in conversation[0]["content"] if p["type"] == "image_pil"]


def _check(hf, conversation, output) -> None:
    tokens, logprobs = _hf_greedy(hf, output.prompt_token_ids, _images(conversation))
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens
    ours = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
    np.testing.assert_allclose(ours, logprobs, atol=2e-4, rtol=0)


def _transformers_prompt(path: str, conversation) -> list[int]:
    """The chat prompt with each image replaced by transformers' Idefics3 / SmolVLM prompt string."""
    tokenizer = Tokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"} if p["type"] == "image_pil" else p
                                      for p in conversation[0]["content"]]}],
        add_generation_prompt=True)
    images = _images(conversation)
    out = _hf_processor()(images=[images], return_row_col_info=True)
    pieces = text.split(TINY_MARKERS["image_token"])
    assert len(pieces) == len(images) + 1
    expanded = pieces[0]
    for rows, cols, piece in zip(out["rows"][0], out["cols"][0], pieces[1:]):
        expanded += get_image_prompt_string(rows, cols, SEQ_LEN, TINY_MARKERS["fake_image_token"],
                                            TINY_MARKERS["image_token"],
                                            TINY_MARKERS["global_image_token"]) + piece
    return tokenizer.encode(expanded)


def test_greedy_tokens_and_logprobs_match_transformers(setup):
    path, llm, hf = setup
    outputs = llm.chat(CONVERSATIONS, PARAMS, use_tqdm=False)
    views = {1: 3, 2: 3 + 5, 4: 3}
    for index, (conversation, output) in enumerate(zip(CONVERSATIONS, outputs)):
        assert output.prompt_token_ids.count(IMAGE_TOKEN) == SEQ_LEN * views.get(index, 0)
        if index in views:
            assert output.prompt_token_ids == _transformers_prompt(path, conversation)
        _check(hf, conversation, output)


def test_repeated_image_hits_prefix_and_encoder_caches(setup):
    _, llm, hf = setup
    picture = _image(120, 50, 9)
    first = llm.chat([_user("What is this?", picture)], PARAMS, use_tqdm=False)[0]
    again = llm.chat([_user("What is this?", picture)], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens >= len(first.prompt_token_ids) // 8 * 8 - 8
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    moved = [{"role": "assistant", "content": "Ready."}, *_user("Now this?", picture)]
    output = llm.chat([moved], PARAMS, use_tqdm=False)[0]
    assert (output.encoder_cache_queries, output.encoder_cache_hits) == (1, 1)
    _check(hf, _user("Now this?", picture), output)  # the same image; the earlier turn is text


def test_budget_planner_takes_fewer_tiles(setup):
    _, llm, _ = setup
    wide = _user("What is written here?", _image(77, 61, 3))  # 2 x 2 tiles + global: 80 tokens
    full = llm.chat([wide], PARAMS, use_tqdm=False)[0]
    small = llm.chat([wide], PARAMS, use_tqdm=False, mm_processor_kwargs={"max_visual_tokens": 40})[0]
    assert full.prompt_token_ids.count(IMAGE_TOKEN) == 5 * SEQ_LEN
    assert small.prompt_token_ids.count(IMAGE_TOKEN) == SEQ_LEN  # one 64px view
