"""A tiny Qwen2-VL checkpoint folder saved by transformers itself (tests only).

Foveal's own tiny checkpoints are exported by Foveal; this one proves that a
folder written by transformers' save_pretrained loads and runs the same way.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

IMAGE_PAD_ID = 12


def write_hf_tiny_qwen2_vl(out_dir: Path) -> Path:
    """Text: hidden 64, 2 layers, 4 heads (2 KV), vocab 512; vision: depth 2,
    embed 32, patch 14, merge 2. generation_config marks every token as EOS,
    so anything that honours EOS stops after one token."""
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from foveal.loader.tiny_tokenizer import write_tiny_tokenizer

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                max_position_embeddings=4096, bos_token_id=0, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_PAD_ID,
                           video_token_id=13, vision_start_token_id=9, vision_end_token_id=10)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(eos_token_id=list(range(512)), pad_token_id=0)
    model.save_pretrained(out_dir)
    write_tiny_tokenizer(out_dir)
    preprocessor = {"min_pixels": 56 * 56, "max_pixels": 448 * 448, "patch_size": 14,
                    "temporal_patch_size": 2, "merge_size": 2,
                    "image_mean": [0.48145466, 0.4578275, 0.40821073],
                    "image_std": [0.26862954, 0.26130258, 0.27577711],
                    "image_processor_type": "Qwen2VLImageProcessor"}
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return out_dir
