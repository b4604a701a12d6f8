"""Greedy parity with transformers through the whole engine: mixed text and
image requests submitted together, with chunked prefill cutting through image
ranges and a KV pool small enough to force preemption."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from foveal import LLM, SamplingParams

MAX_TOKENS = 10


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _conversations() -> list[list[dict]]:
    """8+ requests: text only, one image, two images of different sizes."""
    def user(text, images=()):
        parts = [{"type": "image_pil", "image_pil": im} for im in images]
        return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]
    return [
        user("Hello there, how are you?"),
        user("Describe this picture in detail.", [_image(224, 168, 1)]),
        user("What colour is the sky?"),
        user("Compare the two images.", [_image(112, 280, 2), _image(336, 112, 3)]),
        user("Count the objects.", [_image(140, 140, 4)]),
        user("Write a short poem about the sea and the wind."),
        user("Which one is larger?", [_image(196, 84, 5), _image(84, 196, 6)]),
        user("What is written here?", [_image(250, 190, 7)]),
        user("Tell me a story."),
    ]


def _hf_model(path: str):
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def _hf_inputs(path: str, images: list[Image.Image], image_token_id: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    if not images:
        return {}
    processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    return dict(processor(images=images, return_tensors="pt"))


@torch.inference_mode()
def _hf_greedy(model, prompt_ids: list[int], mm_inputs: dict, image_token_id: int,
               steps: int) -> tuple[list[int], list[float]]:
    """Reference decode: a full forward over the whole sequence at each step
    (no KV cache involved), so every logit comes from transformers alone."""
    ids = list(prompt_ids)
    tokens, logprobs = [], []
    for _ in range(steps):
        input_ids = torch.tensor([ids])
        mm_token_type_ids = (input_ids == image_token_id).long()
        logits = model(input_ids=input_ids, mm_token_type_ids=mm_token_type_ids,
                       **mm_inputs).logits[0, -1].float()
        log_probs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        tokens.append(token)
        logprobs.append(float(log_probs[token]))
        ids.append(token)
    return tokens, logprobs


# target_itl_ms=1: below any step's cost, so every step with decode rows is held
# to the target (no prompt work fits) and the one after it runs without the cap
@pytest.mark.parametrize("preset,target_itl_ms", [("tiny-qwen2-vl", None),
                                                  ("tiny-qwen2.5-vl", None),
                                                  ("tiny-qwen2-vl", 1.0)])
def test_greedy_tokens_and_logprobs_match_transformers(tiny_checkpoints, preset, target_itl_ms):
    path = tiny_checkpoints(preset)
    llm = LLM(model=path, max_model_len=320, max_num_batched_tokens=48,
              max_num_seqs=8, block_size=16, target_itl_ms=target_itl_ms,
              kv_cache_memory_bytes=_pool_bytes(path, num_blocks=20))
    conversations = _conversations()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=1)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    metrics = llm.get_metrics()
    assert metrics["foveal:num_preemptions_total"] > 0, "the KV pool should force preemption"
    assert (metrics["foveal:itl_capped_steps_total"] > 0) == (target_itl_ms is not None)

    model = _hf_model(path)
    image_token_id = model.config.image_token_id
    for conversation, output in zip(conversations, outputs):
        images = [p["image_pil"] for p in conversation[0]["content"] if p["type"] == "image_pil"]
        mm_inputs = _hf_inputs(path, images, image_token_id)
        ref_tokens, ref_logprobs = _hf_greedy(model, output.prompt_token_ids, mm_inputs,
                                              image_token_id, MAX_TOKENS)
        completion = output.outputs[0]
        assert list(completion.token_ids) == ref_tokens
        ours = [step[token].logprob for step, token in zip(completion.logprobs, ref_tokens)]
        np.testing.assert_allclose(ours, ref_logprobs, atol=2e-4, rtol=0)


def _pool_bytes(path: str, num_blocks: int) -> int:
    from foveal.config import CacheConfig
    from foveal.loader.hf_config import model_config_from_hf
    from foveal.worker.kv_cache import kv_cache_spec

    config = model_config_from_hf(path)
    return num_blocks * kv_cache_spec(config, CacheConfig(block_size=16), "float32").block_bytes
