"""HF config dicts (transformers-5 nested layout) for named presets.

Special token ids follow the project's tiny tokenizer (ids 0..13):
<|endoftext|>=0 (bos/pad), <|im_end|>=2 (eos), <|vision_start|>=9,
<|vision_end|>=10, <|image_pad|>=12, <|video_pad|>=13. The real-shape presets
use the same ids so that they run with that tokenizer and dummy weights.
"""
from __future__ import annotations

import copy

from foveal.errors import ConfigError
from foveal.models.gemma3_config import gemma3_presets
from foveal.models.idefics3_config import idefics3_presets
from foveal.models.llava_config import llava_presets

_SPECIAL_TOKENS = {"image_token_id": 12, "video_token_id": 13,
                   "vision_start_token_id": 9, "vision_end_token_id": 10}
_BOS, _EOS, _PAD = 0, 2, 0


def _text(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
          mrope_section: list[int], tied: bool, max_positions: int = 32768,
          theta: float = 1_000_000.0) -> dict:
    return {
        "model_type": "qwen2_vl_text", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_positions, "tie_word_embeddings": tied,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta, "mrope_section": mrope_section},
        "bos_token_id": _BOS, "eos_token_id": _EOS, "pad_token_id": _PAD,
    }


def _qwen2_vl(text: dict, depth: int, embed_dim: int, heads: int) -> dict:
    vision = {"model_type": "qwen2_vl_vision", "depth": depth, "embed_dim": embed_dim,
              "hidden_size": text["hidden_size"], "num_heads": heads, "mlp_ratio": 4,
              "hidden_act": "quick_gelu", "in_channels": 3, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2}
    return {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
            "text_config": text, "vision_config": vision, **_SPECIAL_TOKENS,
            "tie_word_embeddings": text["tie_word_embeddings"],
            "bos_token_id": _BOS, "eos_token_id": _EOS, "pad_token_id": _PAD}


def _qwen2_5_vl(text: dict, depth: int, hidden: int, heads: int, ffn: int,
                window_size: int, fullatt_block_indexes: list[int]) -> dict:
    text = {**text, "model_type": "qwen2_5_vl_text"}
    vision = {"model_type": "qwen2_5_vl_vision", "depth": depth, "hidden_size": hidden,
              "intermediate_size": ffn, "out_hidden_size": text["hidden_size"], "num_heads": heads,
              "hidden_act": "silu", "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "window_size": window_size,
              "fullatt_block_indexes": fullatt_block_indexes, "tokens_per_second": 2}
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "text_config": text, "vision_config": vision, **_SPECIAL_TOKENS,
            "tie_word_embeddings": text["tie_word_embeddings"],
            "bos_token_id": _BOS, "eos_token_id": _EOS, "pad_token_id": _PAD}


def _qwen3_vl(text: dict, head_dim: int, depth: int, hidden: int, heads: int, ffn: int,
              num_position_embeddings: int, deepstack: list[int]) -> dict:
    text = {**text, "model_type": "qwen3_vl_text", "head_dim": head_dim, "attention_bias": False}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
    vision = {"model_type": "qwen3_vl_vision", "depth": depth, "hidden_size": hidden,
              "intermediate_size": ffn, "out_hidden_size": text["hidden_size"], "num_heads": heads,
              "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2,
              "num_position_embeddings": num_position_embeddings,
              "deepstack_visual_indexes": deepstack}
    return {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
            "text_config": text, "vision_config": vision, **_SPECIAL_TOKENS,
            "tie_word_embeddings": text["tie_word_embeddings"],
            "bos_token_id": _BOS, "eos_token_id": _EOS, "pad_token_id": _PAD}


def _moe(config: dict, experts: int, top_k: int, ffn: int, mlp_only: list[int]) -> dict:
    """A Qwen3-VL config as Qwen3-VL-MoE's: sparse MLPs in every layer but mlp_only."""
    text = {**config["text_config"], "model_type": "qwen3_vl_moe_text", "num_experts": experts,
            "num_experts_per_tok": top_k, "moe_intermediate_size": ffn,
            "decoder_sparse_step": 1, "mlp_only_layers": mlp_only}
    return {**config, "architectures": ["Qwen3VLMoeForConditionalGeneration"],
            "model_type": "qwen3_vl_moe", "text_config": text,
            "vision_config": {**config["vision_config"], "model_type": "qwen3_vl_moe_vision"}}


def _tiny_text(layers: int, tied: bool) -> dict:
    return _text(vocab=512, hidden=64, layers=layers, heads=4, kv_heads=2, ffn=128,
                 mrope_section=[2, 3, 3], tied=tied, max_positions=4096, theta=10000.0)


PRESETS: dict[str, dict] = {
    "tiny-qwen2-vl": _qwen2_vl(_tiny_text(layers=2, tied=True), depth=2, embed_dim=32, heads=4),
    "tiny-qwen2.5-vl": _qwen2_5_vl(_tiny_text(layers=3, tied=False), depth=4, hidden=32, heads=4,
                                   ffn=64, window_size=56, fullatt_block_indexes=[1, 3]),
    # The trained demo model (foveal/assets/demo_model): ~9M parameters.
    "demo": _qwen2_vl(_text(vocab=1024, hidden=256, layers=4, heads=8, kv_heads=4, ffn=768,
                            mrope_section=[4, 6, 6], tied=True, max_positions=4096,
                            theta=10000.0),
                      depth=8, embed_dim=192, heads=6),
    "small": _qwen2_vl(_text(vocab=32000, hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864,
                             mrope_section=[8, 12, 12], tied=True),
                       depth=12, embed_dim=768, heads=12),
    "qwen2-vl-2b": _qwen2_vl(_text(vocab=151936, hidden=1536, layers=28, heads=12, kv_heads=2,
                                   ffn=8960, mrope_section=[16, 24, 24], tied=True),
                             depth=32, embed_dim=1280, heads=16),
    "qwen2.5-vl-3b": _qwen2_5_vl(_text(vocab=151936, hidden=2048, layers=36, heads=16, kv_heads=2,
                                       ffn=11008, mrope_section=[16, 24, 24], tied=True,
                                       max_positions=128000),
                                 depth=32, hidden=1280, heads=16, ffn=3420, window_size=112,
                                 fullatt_block_indexes=[7, 15, 23, 31]),
    "tiny-qwen3-vl": _qwen3_vl(_text(vocab=512, hidden=64, layers=3, heads=4, kv_heads=2, ffn=128,
                                     mrope_section=[4, 2, 2], tied=False, max_positions=4096,
                                     theta=10000.0),
                               head_dim=16, depth=3, hidden=32, heads=2, ffn=64,
                               num_position_embeddings=64, deepstack=[0, 2]),
    "tiny-qwen3-vl-moe": _moe(_qwen3_vl(_text(vocab=512, hidden=64, layers=3, heads=4, kv_heads=2,
                                              ffn=128, mrope_section=[4, 2, 2], tied=False,
                                              max_positions=4096, theta=10000.0),
                                        head_dim=16, depth=3, hidden=32, heads=2, ffn=64,
                                        num_position_embeddings=64, deepstack=[0, 2]),
                              experts=8, top_k=2, ffn=48, mlp_only=[1]),
    # Qwen3-VL-30B-A3B-Instruct's shapes.
    "qwen3-vl-30b-a3b": _moe(_qwen3_vl(_text(vocab=151936, hidden=2048, layers=48, heads=32,
                                             kv_heads=4, ffn=6144, mrope_section=[24, 20, 20],
                                             tied=False, max_positions=262144,
                                             theta=5_000_000.0),
                                       head_dim=128, depth=27, hidden=1152, heads=16, ffn=4304,
                                       num_position_embeddings=2304, deepstack=[8, 16, 24]),
                             experts=128, top_k=8, ffn=768, mlp_only=[]),
    # Qwen3-VL-2B-Instruct's shapes.
    "qwen3-vl-2b": _qwen3_vl(_text(vocab=151936, hidden=2048, layers=28, heads=16, kv_heads=8,
                                   ffn=6144, mrope_section=[24, 20, 20], tied=True,
                                   max_positions=262144, theta=5_000_000.0),
                             head_dim=128, depth=24, hidden=1024, heads=16, ffn=4096,
                             num_position_embeddings=2304, deepstack=[5, 11, 17]),
    "qwen2.5-vl-7b": _qwen2_5_vl(_text(vocab=152064, hidden=3584, layers=28, heads=28, kv_heads=4,
                                       ffn=18944, mrope_section=[16, 24, 24], tied=False,
                                       max_positions=128000),
                                 depth=32, hidden=1280, heads=16, ffn=3420, window_size=112,
                                 fullatt_block_indexes=[7, 15, 23, 31]),
    # Gemma 3: <|vision_start|> / <|vision_end|> / <|image_pad|> stand for <start_of_image> /
    # <end_of_image> / the image soft token.
    **gemma3_presets({"bos": _BOS, "eos": _EOS, "pad": _PAD, "boi": 9, "eoi": 10, "image": 12}),
    # LLaVA: <|image_pad|> stands for <image>.
    **llava_presets({"bos": _BOS, "eos": _EOS, "pad": _PAD, "image": 12, "video": 13}),
    # Idefics3 / SmolVLM: <|image_pad|> stands for <image>.
    **idefics3_presets({"bos": _BOS, "eos": _EOS, "pad": _PAD, "image": 12}),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str) -> dict:
    """A fresh copy of the HF config dict of preset `name`."""
    if name not in PRESETS:
        raise ConfigError(f"preset {name!r} is unknown; choose one of {', '.join(preset_names())}")
    return copy.deepcopy(PRESETS[name])
