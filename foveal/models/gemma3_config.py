"""Gemma 3's config.json -> foveal.config.ModelConfig (torch-free, read once at the edge).

Hub checkpoints of Gemma 3 list only what differs from transformers' defaults
(google/gemma-3-4b-it's text_config names 4 keys), so the defaults live here.
Both layouts are read: transformers-5 `rope_parameters` per layer type
({"full_attention": {...}, "sliding_attention": {...}}) and the older
`rope_theta` / `rope_local_base_freq` / `rope_scaling` keys.
"""
from __future__ import annotations

from dataclasses import dataclass

from foveal.config import CheckpointQuantization, ModelConfig, TextConfig, VisionConfig
from foveal.errors import ConfigError

# transformers' Gemma3TextConfig / SiglipVisionConfig defaults (Gemma 3 4B's text shape differs).
_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "final_logit_softcapping": None, "attn_logit_softcapping": None,
}
_VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                    "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
                    "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0


@dataclass(frozen=True)
class Gemma3Settings:
    """What Gemma 3 needs beyond TextConfig / VisionConfig (ModelConfig.family_config)."""

    sliding_window: int
    sliding_layers: tuple[bool, ...]  # per decoder layer: sliding-window attention?
    local_rope_theta: float  # rope base of the sliding layers
    global_rope_scaling: float  # linear position scaling of the full-attention layers (1: none)
    query_pre_attn_scalar: float  # attention scale = query_pre_attn_scalar ** -0.5
    final_logit_softcapping: float | None
    mm_tokens_per_image: int
    image_size: int  # the vision tower's square input side, pixels
    vision_layer_norm_eps: float
    boi_token_id: int  # <start_of_image>: a prompt's image placeholder
    eoi_token_id: int  # <end_of_image>


def _rope(text: dict) -> tuple[float, float, float]:
    """(global theta, local theta, global linear scaling factor)."""
    params = text.get("rope_parameters") or {}
    full = params.get("full_attention") or {}
    sliding = params.get("sliding_attention") or {}
    scaling = text.get("rope_scaling") or {}
    full = {**scaling, **full}
    rope_type = full.get("rope_type", full.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise ConfigError(f"Gemma 3 rope_type {rope_type!r} is not supported; Foveal reads "
                          "'default' and 'linear' (Gemma 3's own)")
    if sliding.get("rope_type", "default") != "default":
        raise ConfigError("Gemma 3 sliding_attention layers must use the default rope_type")
    factor = float(full.get("factor", 1.0)) if rope_type == "linear" else 1.0
    global_theta = float(full.get("rope_theta", text.get("rope_theta", _GLOBAL_THETA)))
    local_theta = float(sliding.get("rope_theta", text.get("rope_local_base_freq", _LOCAL_THETA)))
    return global_theta, local_theta, factor


def _sliding_layers(text: dict) -> tuple[bool, ...]:
    layer_types = text.get("layer_types")
    if layer_types:
        unknown = set(layer_types) - {"sliding_attention", "full_attention"}
        if unknown or len(layer_types) != text["num_hidden_layers"]:
            raise ConfigError(f"layer_types {layer_types} must name sliding_attention or "
                              f"full_attention once per layer ({text['num_hidden_layers']})")
        return tuple(kind == "sliding_attention" for kind in layer_types)
    pattern = text["sliding_window_pattern"]
    return tuple(bool((i + 1) % pattern) for i in range(text["num_hidden_layers"]))


def gemma3_model_config(hf: dict, path: str | None, eos_token_ids: tuple[int, ...],
                        checkpoint_dtype: str | None,
                        checkpoint_quantization: CheckpointQuantization | None) -> ModelConfig:
    """A Gemma3ForConditionalGeneration config.json dict (either layout) -> ModelConfig."""
    text = {**_TEXT_DEFAULTS, **(hf.get("text_config") or {})}
    vision = {**_VISION_DEFAULTS, **(hf.get("vision_config") or {})}
    if text.get("attn_logit_softcapping") is not None:
        raise ConfigError("Gemma 3 with attn_logit_softcapping set is not supported (Gemma 3 "
                          "checkpoints leave it null); the paged attention has no softcap")
    if text.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention (embedding models) is not supported")
    if vision.get("vision_use_head"):
        raise ConfigError("a SigLIP vision tower with vision_use_head is not Gemma 3's layout")
    global_theta, local_theta, factor = _rope(text)
    tokens_per_image = int(hf.get("mm_tokens_per_image", 256))
    patches_per_side = vision["image_size"] // vision["patch_size"]
    tokens_per_side = int(round(tokens_per_image ** 0.5))
    if tokens_per_side ** 2 != tokens_per_image or patches_per_side % tokens_per_side:
        raise ConfigError(f"mm_tokens_per_image {tokens_per_image} must be a square whose side "
                          f"divides image_size / patch_size = {patches_per_side}")
    text_config = TextConfig(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"], num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=text["num_attention_heads"],
        num_key_value_heads=text["num_key_value_heads"], head_dim=text["head_dim"],
        rms_norm_eps=text["rms_norm_eps"], rope_theta=global_theta, mrope_section=(),
        max_position_embeddings=text["max_position_embeddings"],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
        hidden_act=text.get("hidden_act") or text["hidden_activation"],
        attention_bias=bool(text.get("attention_bias", False)),
        layer_windows=tuple(int(text["sliding_window"]) if sliding else 0
                            for sliding in _sliding_layers(text)))
    vision_config = VisionConfig(
        variant="siglip", depth=vision["num_hidden_layers"], hidden_size=vision["hidden_size"],
        num_heads=vision["num_attention_heads"], intermediate_size=vision["intermediate_size"],
        out_hidden_size=text["hidden_size"], patch_size=vision["patch_size"], temporal_patch_size=1,
        spatial_merge_size=patches_per_side // tokens_per_side, in_channels=vision["num_channels"],
        hidden_act=vision["hidden_act"])
    settings = Gemma3Settings(
        sliding_window=int(text["sliding_window"]), sliding_layers=_sliding_layers(text),
        local_rope_theta=local_theta, global_rope_scaling=factor,
        query_pre_attn_scalar=float(text["query_pre_attn_scalar"]),
        final_logit_softcapping=text.get("final_logit_softcapping"),
        mm_tokens_per_image=tokens_per_image, image_size=vision["image_size"],
        vision_layer_norm_eps=vision["layer_norm_eps"],
        boi_token_id=hf.get("boi_token_index", hf.get("boi_token_id", 255_999)),
        eoi_token_id=hf.get("eoi_token_index", hf.get("eoi_token_id", 256_000)))
    image_token_id = hf.get("image_token_index", hf.get("image_token_id", 262_144))
    return ModelConfig(
        architecture="Gemma3ForConditionalGeneration", model_type=hf.get("model_type", "gemma3"),
        text=text_config, vision=vision_config, image_token_id=image_token_id,
        video_token_id=-1, vision_start_token_id=settings.boi_token_id,
        vision_end_token_id=settings.eoi_token_id, eos_token_ids=eos_token_ids, path=path,
        checkpoint_dtype=checkpoint_dtype, checkpoint_quantization=checkpoint_quantization,
        family_config=settings)


def _preset(text: dict, vision: dict, tokens_per_image: int, special: dict[str, int]) -> dict:
    pattern = text.pop("pattern")  # every pattern-th layer has full attention
    layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                   for i in range(text["num_hidden_layers"])]
    text = {"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6, "layer_types": layer_types, "final_logit_softcapping": None,
            "attn_logit_softcapping": None, "bos_token_id": special["bos"],
            "eos_token_id": special["eos"], "pad_token_id": special["pad"], **text}
    vision = {"model_type": "siglip_vision_model", "hidden_act": "gelu_pytorch_tanh",
              "layer_norm_eps": 1e-6, "num_channels": 3, "vision_use_head": False, **vision}
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": text, "vision_config": vision, "mm_tokens_per_image": tokens_per_image,
            "boi_token_index": special["boi"], "eoi_token_index": special["eoi"],
            "image_token_index": special["image"], "tie_word_embeddings": True,
            "bos_token_id": special["bos"], "eos_token_id": special["eos"],
            "pad_token_id": special["pad"]}


def _rope_parameters(theta: float, factor: float, local_theta: float) -> dict:
    full = {"rope_type": "linear", "factor": factor} if factor != 1.0 else {"rope_type": "default"}
    return {"full_attention": {**full, "rope_theta": theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}


def gemma3_presets(special: dict[str, int]) -> dict[str, dict]:
    """Preset name -> HF config dict; special: bos / eos / pad / boi / eoi / image ids."""
    return {
        # sliding_window 16 and images of 16 tokens: the window cuts through prompts and images
        "tiny-gemma3": _preset(
            {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "pattern": 2,
             "sliding_window": 16, "query_pre_attn_scalar": 16, "max_position_embeddings": 4096,
             "rope_parameters": _rope_parameters(10_000.0, 2.0, 100.0)},
            {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "image_size": 112, "patch_size": 14}, 16, special),
        # google/gemma-3-4b-it's shapes
        "gemma-3-4b": _preset(
            {"vocab_size": 262_208, "hidden_size": 2560, "intermediate_size": 10240,
             "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 256, "pattern": 6, "sliding_window": 1024, "query_pre_attn_scalar": 256,
             "max_position_embeddings": 131_072,
             "rope_parameters": _rope_parameters(_GLOBAL_THETA, 8.0, _LOCAL_THETA)},
            {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
             "num_attention_heads": 16, "image_size": 896, "patch_size": 14}, 256, special),
    }
