"""Transformers reference models for parity tests (tests only).

Builds a tiny transformers Qwen2-VL / Qwen2.5-VL from a Foveal preset dict
with non-flat random weights, makes image inputs with transformers' own
processor and runs its forward with the inputs it needs for M-RoPE.
"""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

_HF_CLASSES = {
    "Qwen2VLForConditionalGeneration": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
    "Qwen2_5_VLForConditionalGeneration": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
}
FIRST_TEXT_TOKEN = 14  # ids 0..13 are the tiny tokenizer's special tokens


def hf_model_from_preset(hf_config: dict, seed: int = 0) -> torch.nn.Module:
    """An fp32 eval transformers model of `hf_config` with weights drawn so
    that logits have clear margins (std 1/sqrt(fan_in) <= 0.2, embeddings 0.2)."""
    config_cls, model_cls = _HF_CLASSES[hf_config["architectures"][0]]
    config = config_cls(**hf_config)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                is_norm = "norm" in name or "ln_q" in name
                param.copy_(torch.ones_like(param) if is_norm and name.endswith("weight")
                            else torch.randn(param.shape, generator=generator) * 0.02)
            else:
                std = 0.2 if "embed_tokens" in name or "lm_head" in name else min(0.2, param[0].numel() ** -0.5)
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


def random_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_inputs(sizes: list[tuple[int, int]], max_pixels: int = 28 * 28 * 64):
    """Images of (width, height) -> (pixel_values (N, 1176), grid_thw (num_images, 3))."""
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels)
    images = [random_image(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"].float(), out["image_grid_thw"]


def prompt_with_images(hf_config: dict, grid_thw: torch.Tensor, text_lengths: list[int],
                       seed: int = 0) -> tuple[list[int], list[tuple[int, int]]]:
    """Random text runs around each image (vision_start, image_pad * n, vision_end).

    text_lengths has len(grid_thw) + 1 entries. Returns token ids and each
    image's placeholder (offset, length)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = hf_config["text_config"]["vocab_size"]
    merge = hf_config["vision_config"]["spatial_merge_size"]
    tokens, placeholders = [], []
    for index, text_len in enumerate(text_lengths):
        tokens += torch.randint(FIRST_TEXT_TOKEN, vocab, (text_len,), generator=generator).tolist()
        if index == len(grid_thw):
            break
        num_image_tokens = int(grid_thw[index].prod()) // merge ** 2
        tokens.append(hf_config["vision_start_token_id"])
        placeholders.append((len(tokens), num_image_tokens))
        tokens += [hf_config["image_token_id"]] * num_image_tokens
        tokens.append(hf_config["vision_end_token_id"])
    return tokens, placeholders


def mm_token_type_ids(hf_config: dict, token_ids: list[int]) -> torch.Tensor:
    """(1, T): 1 for image tokens, 2 for video tokens, else 0. Without it
    transformers silently falls back to 1-D positions."""
    ids = torch.tensor([token_ids])
    types = (ids == hf_config["image_token_id"]).long()
    return types + 2 * (ids == hf_config["video_token_id"]).long()


@torch.no_grad()
def hf_logits(model, hf_config: dict, token_ids: list[int], pixel_values=None,
              grid_thw=None) -> torch.Tensor:
    """(T, vocab) fp32 logits of a full forward of one sequence."""
    kwargs = {}
    if pixel_values is not None:
        kwargs = {"pixel_values": pixel_values, "image_grid_thw": grid_thw}
    out = model(input_ids=torch.tensor([token_ids]),
                mm_token_type_ids=mm_token_type_ids(hf_config, token_ids), use_cache=False, **kwargs)
    return out.logits[0].float()


def hf_rope_index(model, hf_config: dict, token_ids: list[int], grid_thw) -> tuple[torch.Tensor, int]:
    """transformers' M-RoPE ids (3, T) and delta for one sequence."""
    positions, deltas = model.model.get_rope_index(
        torch.tensor([token_ids]), mm_token_type_ids(hf_config, token_ids), image_grid_thw=grid_thw)
    return positions[:, 0], int(deltas.flatten()[0])


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], inputs: dict, steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from a full transformers forward per step (no KV
    cache): every logit comes from transformers alone. inputs: the media kwargs."""
    ids, tokens, logprobs = list(prompt_ids), [], []
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([ids]), **inputs).logits[0, -1].float()
        token = int(torch.argmax(logits))
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return tokens, logprobs
