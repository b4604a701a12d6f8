"""Tiny LLaVA-1.5 / NeXT / OneVision checkpoints saved by transformers (tests only).

Random weights drawn so logits have clear margins (std 1/sqrt(fan_in) <= 0.2,
embeddings 0.2), the project's tiny tokenizer (<|image_pad|> = 12 is the image
token), the LLaVA-1.5-style template of Foveal's tiny checkpoints and
transformers' own PIL image processor config.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from foveal.multimodal.processors.llava_family import LLAVA_CHAT_TEMPLATE

IMAGE_TOKEN_ID = 12
_TILE = 56
NEXT_PINPOINTS = [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]
ONEVISION_PINPOINTS = [[56 * i, 56 * j] for i in range(1, 4) for j in range(1, 4)]


def _text(model_type: str, rope: dict | None = None) -> dict:
    text = dict(model_type=model_type, vocab_size=512, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
                rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    if model_type == "qwen2":
        text["tie_word_embeddings"] = False
    return text


def hf_config(variant: str, rope: dict | None = None):
    """rope: the Llama decoder's rope_parameters (default RoPE when None)."""
    from transformers import LlavaConfig, LlavaNextConfig, LlavaOnevisionConfig

    common = dict(image_token_index=IMAGE_TOKEN_ID, tie_word_embeddings=False)
    if variant == "llava_onevision":
        vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
                      num_hidden_layers=3, num_attention_heads=2, image_size=_TILE, patch_size=14,
                      vision_use_head=False)
        return LlavaOnevisionConfig(text_config=_text("qwen2"), vision_config=vision,
                                    image_grid_pinpoints=ONEVISION_PINPOINTS,
                                    vision_aspect_ratio="anyres_max_2", video_token_index=13, **common)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=3, num_attention_heads=4, image_size=_TILE, patch_size=14,
                  projection_dim=32)
    if variant == "llava_next":
        return LlavaNextConfig(text_config=_text("llama"), vision_config=vision,
                               image_grid_pinpoints=NEXT_PINPOINTS, **common)
    return LlavaConfig(text_config=_text("llama", rope), vision_config=vision, **common)


def image_processor(variant: str):
    from transformers import CLIPImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    crop = {"height": _TILE, "width": _TILE}
    if variant == "llava":
        return CLIPImageProcessorPil(size={"shortest_edge": _TILE}, crop_size=crop)
    if variant == "llava_next":
        return LlavaNextImageProcessorPil(size={"shortest_edge": _TILE}, crop_size=crop,
                                          image_grid_pinpoints=NEXT_PINPOINTS)
    return LlavaOnevisionImageProcessorPil(size={"height": _TILE, "width": _TILE},
                                           image_grid_pinpoints=ONEVISION_PINPOINTS)


def hf_model(variant: str, seed: int = 0, rope: dict | None = None) -> torch.nn.Module:
    import transformers

    config = hf_config(variant, rope)
    config._attn_implementation = "sdpa"
    cls = getattr(transformers, config.architectures[0] if config.architectures else
                  {"llava": "LlavaForConditionalGeneration",
                   "llava_next": "LlavaNextForConditionalGeneration",
                   "llava_onevision": "LlavaOnevisionForConditionalGeneration"}[variant])
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                is_norm = "norm" in name
                param.copy_(torch.ones_like(param) + torch.randn(param.shape, generator=generator) * 0.05
                            if is_norm and name.endswith("weight")
                            else torch.randn(param.shape, generator=generator) * 0.05)
            else:
                embedding = "embed_tokens" in name or "lm_head" in name
                std = 0.2 if embedding else min(0.2, param[0].numel() ** -0.5)
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


def write_checkpoint(variant: str, out_dir: Path, rope: dict | None = None) -> Path:
    from transformers import GenerationConfig

    from foveal.loader.tiny_tokenizer import write_tiny_tokenizer

    model = hf_model(variant, rope=rope)
    model.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=0, bos_token_id=0)
    model.save_pretrained(out_dir)
    write_tiny_tokenizer(out_dir)
    (out_dir / "chat_template.jinja").write_text(LLAVA_CHAT_TEMPLATE, encoding="utf-8")
    tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = LLAVA_CHAT_TEMPLATE
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    image_processor(variant).save_pretrained(out_dir)
    return out_dir
