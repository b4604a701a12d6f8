"""Qwen3-VL through the whole engine equals transformers: greedy tokens and
logprobs for a mixed batch with chunked prefill cutting through image ranges
(DeepStack rows included), a multi-image prompt, a video with timestamps, and
prefix- and encoder-cache hits on a repeated image."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from foveal import LLM, SamplingParams

PRESET = "tiny-qwen3-vl"
MAX_TOKENS = 5
KV_BYTES = 8 << 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _frames(num_frames: int, width: int, height: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(num_frames)]


def _user(text: str, images=()) -> list[dict]:
    parts = [{"type": "image_pil", "image_pil": image} for image in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def setup(tiny_checkpoints):
    import transformers

    path = tiny_checkpoints(PRESET)
    hf_model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32).eval()
    return path, hf_model


def _hf_inputs(request, config) -> dict:
    """transformers' inputs from the engine's processed features (same pixels)."""
    inputs = {}
    for modality, pixels_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                           ("video", "pixel_values_videos", "video_grid_thw")):
        features = [f for f in request.mm_features if f.modality == modality]
        if features:
            inputs[pixels_key] = torch.cat([torch.as_tensor(f.data[pixels_key]) for f in features])
            inputs[grid_key] = torch.tensor([list(f.data["grid_thw"]) for f in features])
    return inputs


@torch.inference_mode()
def _hf_greedy(model, prompt_ids: list[int], inputs: dict, config) -> tuple[list[int], list[float]]:
    """A full forward over the whole sequence per step: every logit is transformers' own."""
    ids, tokens, logprobs = list(prompt_ids), [], []
    for _ in range(MAX_TOKENS):
        input_ids = torch.tensor([ids])
        types = (input_ids == config.image_token_id).long() + 2 * (input_ids == config.video_token_id).long()
        types[0, len(prompt_ids):] = 0  # generated tokens are text, whatever their ids
        logits = model(input_ids=input_ids, mm_token_type_ids=types, **inputs).logits[0, -1].float()
        token = int(torch.argmax(logits))
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        ids.append(token)
    return tokens, logprobs


def _assert_match(llm, hf_model, prompts_or_requests, outputs) -> None:
    config = llm.llm_engine.config.model
    processor = llm.llm_engine.input_processor
    for prompt, output in zip(prompts_or_requests, outputs):
        request = processor.process("ref", prompt, GREEDY).request
        assert request.prompt_token_ids == output.prompt_token_ids
        tokens, logprobs = _hf_greedy(hf_model, output.prompt_token_ids, _hf_inputs(request, config), config)
        completion = output.outputs[0]
        assert list(completion.token_ids) == tokens
        ours = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
        np.testing.assert_allclose(ours, logprobs, atol=2e-4, rtol=0)


def _prompt(llm, conversation: list[dict], media: dict) -> dict:
    text = llm.get_tokenizer().apply_chat_template(conversation, add_generation_prompt=True)
    return {"prompt": text, "multi_modal_data": media}


def test_mixed_batch_with_chunks_through_images_matches_transformers(setup):
    """Text-only and image requests together; 24-token chunks cut through the
    image ranges (the first image holds 48 tokens), DeepStack rows sliced with them."""
    path, hf_model = setup
    llm = LLM(model=path, max_model_len=512, max_num_batched_tokens=24, max_num_seqs=4, block_size=16,
              kv_cache_memory_bytes=KV_BYTES)
    images = {"one": [_image(256, 200, 1)], "two": [_image(96, 224, 2), _image(250, 90, 3)]}
    conversations = [[{"role": "user", "content": [{"type": "image"}] * len(v) + [
        {"type": "text", "text": f"Describe {k}."}]}] for k, v in images.items()]
    prompts = [_prompt(llm, c, {"image": v}) for c, v in zip(conversations, images.values())]
    prompts.insert(1, {"prompt": "Hello there, how are you?"})
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    request = llm.llm_engine.input_processor.process("check", prompts[0], GREEDY).request
    assert request.mm_features[0].placeholder.length == 48  # > one chunk: it is cut
    _assert_match(llm, hf_model, prompts, outputs)


def test_video_with_timestamps_and_image_matches_transformers(setup):
    path, hf_model = setup
    llm = LLM(model=path, max_model_len=1024, max_num_batched_tokens=32, block_size=16,
              kv_cache_memory_bytes=KV_BYTES)
    video = {"frames": _frames(6, 96, 64, seed=4), "fps": 1.0}  # temporal patches at 0.5, 2.5, 4.5 s
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                                 {"type": "text", "text": "Is it in the clip?"}]}]
    prompt = _prompt(llm, conversation, {"image": _image(80, 80, 5), "video": video})
    output = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    text = llm.get_tokenizer().decode(output.prompt_token_ids, skip_special_tokens=False)
    assert "<0.5 seconds><|vision_start|><|video_pad|>" in text
    assert "<4.5 seconds>" in text and "<|vision_start|><0.5" not in text
    _assert_match(llm, hf_model, [prompt], [output])


def test_repeated_image_hits_prefix_and_encoder_caches(setup):
    """The same image three times: the second prompt starts like the first (prefix
    hit over the image), the third has other text first (encoder-cache hit): the
    image is encoded once and every answer still equals transformers'."""
    path, hf_model = setup
    llm = LLM(model=path, max_model_len=512, max_num_batched_tokens=512, block_size=16,
              kv_cache_memory_bytes=KV_BYTES)
    image = _image(256, 256, 6)  # 64 visual tokens

    def ask(before: list[dict], question: str) -> dict:
        content = before + [{"type": "image"}, {"type": "text", "text": question}]
        return _prompt(llm, [{"role": "user", "content": content}], {"image": image})

    prompts = [ask([], "What is it?"), ask([], "Colours?"),
               ask([{"type": "text", "text": "Look at this picture please."}], "Shapes?")]
    outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    metrics = llm.get_metrics()
    assert metrics["foveal:prefix_cache_hits_total"] >= 64  # the image's 4 full blocks at least
    assert metrics["foveal:encoder_items_total"] == 1
    _assert_match(llm, hf_model, prompts, outputs)
