"""LLaVA config.json (llava / llava_next / llava_onevision) -> ModelConfig, torch-free.

Hub checkpoints list only what differs from transformers' defaults
(llava-hf/llava-1.5-7b-hf's text_config names 6 keys), so the defaults live
here. Both layouts are read: `image_token_id` / `image_token_index`, nested
`rope_parameters` or the older `rope_theta` / `rope_scaling`.

The vision tower's numbers go into `VisionConfig` (variant "clip" / "siglip";
no temporal patches, no merging); what only LLaVA has is `LlavaSettings`
(`ModelConfig.family_config`).
"""
from __future__ import annotations

from dataclasses import dataclass

from foveal.config import CheckpointQuantization, ModelConfig, RopeScaling, TextConfig, VisionConfig
from foveal.errors import ConfigError

# model_type -> (image token, video token, select strategy, feature layer, tower defaults)
_CLIP_336 = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
             "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14}
_SIGLIP_384 = {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
               "num_hidden_layers": 26, "num_attention_heads": 16, "image_size": 384, "patch_size": 14,
               "vision_use_head": False}
_FAMILY_DEFAULTS = {
    "llava": (32000, -1, "default", -2, _CLIP_336),
    "llava_next": (32000, -1, "default", -2, _CLIP_336),
    "llava_onevision": (151646, 151647, "full", -1, _SIGLIP_384),
}
_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
_ONEVISION_PINPOINTS = tuple((384 * i, 384 * j) for i in range(1, 7) for j in range(1, 7))
# vision model_type -> (variant, hidden_act default, layer_norm_eps default, transformers' defaults)
_TOWERS = {
    "clip_vision_model": ("clip", "quick_gelu", 1e-5, {"patch_size": 32}),
    "siglip_vision_model": ("siglip", "gelu_pytorch_tanh", 1e-6, {"patch_size": 16}),
}
_TOWER_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                   "num_attention_heads": 12, "image_size": 224, "num_channels": 3}

# transformers' LlamaConfig / MistralConfig / Qwen2Config defaults.
_DECODER_DEFAULTS = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "attention_bias": False, "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "attention_bias": True},
}


@dataclass(frozen=True)
class LlavaSettings:
    """What LLaVA needs beyond TextConfig / VisionConfig (ModelConfig.family_config)."""

    variant: str  # "llava" (1.5) | "llava_next" | "llava_onevision"
    image_size: int  # the tower's square input side, pixels
    vision_layer_norm_eps: float
    feature_layers: tuple[int, ...]  # hidden states read from the tower (concatenated)
    select_strategy: str  # "default": drop the CLS row; "full": keep every row
    projector_act: str
    projector_bias: bool
    grid_pinpoints: tuple[tuple[int, int], ...]  # anyres (height, width) canvases; () for 1.5
    max_tiles: int = 0  # OneVision "anyres_max_N": unpadded tile features pooled to <= N tiles


def decoder_text_config(text: dict, tie_word_embeddings: bool = False) -> TextConfig:
    """An HF text_config dict of a Llama, Mistral or Qwen2 decoder -> TextConfig.

    Linear and llama3 RoPE scaling are read; other scalings (dynamic, yarn, ...) and
    sliding-window attention are a ConfigError."""
    model_type = text.get("model_type", "llama")
    if model_type not in _DECODER_DEFAULTS:
        raise ConfigError(f"text model_type {model_type!r} is not a decoder LLaVA runs on; "
                          f"supported: {sorted(_DECODER_DEFAULTS)}")
    text = {**_DECODER_DEFAULTS[model_type], **text}  # an explicit null (sliding_window) stays null
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    scaling = rope_scaling(rope, model_type)
    if text.get("use_sliding_window") or (model_type == "mistral" and text.get("sliding_window")):
        raise ConfigError(f"{model_type} sliding-window attention (sliding_window="
                          f"{text.get('sliding_window')}) is not supported; use a checkpoint without it")
    heads = text["num_attention_heads"]
    return TextConfig(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"], num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        rms_norm_eps=text["rms_norm_eps"],
        rope_theta=float(rope.get("rope_theta") or text["rope_theta"] or 10000.0),
        mrope_section=(), max_position_embeddings=text["max_position_embeddings"],
        tie_word_embeddings=bool(tie_word_embeddings or text.get("tie_word_embeddings")),
        hidden_act=text.get("hidden_act", "silu"), attention_bias=bool(text["attention_bias"]),
        rope_scaling=scaling)


def rope_scaling(rope: dict, model_type: str) -> RopeScaling | None:
    """The RoPE scaling of merged rope_scaling / rope_parameters: default, linear or llama3."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in ("linear", "llama3"):
        raise ConfigError(f"rope_type {rope_type!r} ({model_type} text config) is not supported; "
                          "supported: default, linear, llama3")
    if rope_type == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    return RopeScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                       float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))


def _tower(vision: dict, text_hidden: int) -> tuple[VisionConfig, int, float]:
    """(VisionConfig, image size, layer-norm eps) of a CLIP / SigLIP vision_config."""
    model_type = vision.get("model_type", "clip_vision_model")
    if model_type not in _TOWERS:
        raise ConfigError(f"LLaVA vision tower {model_type!r} is not supported; supported: {sorted(_TOWERS)}")
    variant, act, eps, defaults = _TOWERS[model_type]
    if vision.get("vision_use_head"):
        raise ConfigError("a SigLIP tower with vision_use_head=true is not a LLaVA tower; set it false")
    v = {**_TOWER_DEFAULTS, **defaults, **vision}
    config = VisionConfig(
        variant=variant, depth=v["num_hidden_layers"], hidden_size=v["hidden_size"],
        num_heads=v["num_attention_heads"], intermediate_size=v["intermediate_size"],
        out_hidden_size=text_hidden, patch_size=v["patch_size"], temporal_patch_size=1,
        spatial_merge_size=1, in_channels=v["num_channels"], hidden_act=v.get("hidden_act", act))
    return config, v["image_size"], v.get("layer_norm_eps", eps)


def _settings(hf: dict, model_type: str, image_size: int, eps: float, strategy: str,
              layer) -> LlavaSettings:
    if strategy not in ("default", "full"):
        raise ConfigError(f"vision_feature_select_strategy {strategy!r}; use 'default' or 'full'")
    pinpoints = {"llava": (), "llava_next": _NEXT_PINPOINTS,
                 "llava_onevision": _ONEVISION_PINPOINTS}[model_type]
    if model_type != "llava" and hf.get("image_grid_pinpoints"):
        pinpoints = tuple((int(h), int(w)) for h, w in hf["image_grid_pinpoints"])
    max_tiles = 0
    if model_type == "llava_onevision":
        ratio = hf.get("vision_aspect_ratio", "anyres_max_9")
        if not ratio.startswith("anyres_max_"):
            raise ConfigError(f"vision_aspect_ratio {ratio!r}; Foveal reads 'anyres_max_N'")
        max_tiles = int(ratio.removeprefix("anyres_max_"))
    return LlavaSettings(
        variant=model_type, image_size=image_size, vision_layer_norm_eps=eps,
        feature_layers=tuple(layer) if isinstance(layer, (list, tuple)) else (int(layer),),
        select_strategy=strategy, projector_act=hf.get("projector_hidden_act", "gelu"),
        projector_bias=bool(hf.get("multimodal_projector_bias", True)), grid_pinpoints=pinpoints,
        max_tiles=max_tiles)


def llava_model_config(hf: dict, path: str | None, eos: tuple[int, ...], stored_dtype: str | None,
                       quantization: CheckpointQuantization | None) -> ModelConfig:
    model_type = hf.get("model_type", "llava")
    if model_type not in _FAMILY_DEFAULTS:
        raise ConfigError(f"model_type {model_type!r} is not a LLaVA variant; supported: "
                          f"{sorted(_FAMILY_DEFAULTS)}")
    image_id, video_id, strategy, layer, tower = _FAMILY_DEFAULTS[model_type]
    text = decoder_text_config(hf.get("text_config") or {}, bool(hf.get("tie_word_embeddings")))
    vision, image_size, eps = _tower(hf.get("vision_config") or tower, text.hidden_size)
    image_id = hf.get("image_token_id", hf.get("image_token_index", image_id))
    video_id = hf.get("video_token_id", hf.get("video_token_index", video_id))
    settings = _settings(hf, model_type, image_size, eps,
                         hf.get("vision_feature_select_strategy", strategy),
                         hf.get("vision_feature_layer", layer))
    return ModelConfig(
        architecture=hf["architectures"][0], model_type=model_type, text=text, vision=vision,
        image_token_id=image_id, video_token_id=video_id, vision_start_token_id=-1,
        vision_end_token_id=-1, eos_token_ids=eos, path=path, checkpoint_dtype=stored_dtype,
        checkpoint_quantization=quantization, family_config=settings)


def _preset_text(model_type: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                 ffn: int, theta: float, max_positions: int, tied: bool, ids: dict) -> dict:
    return {"model_type": model_type, "vocab_size": vocab, "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": ffn, "hidden_act": "silu",
            "rms_norm_eps": 1e-6 if model_type == "qwen2" else 1e-5,
            "max_position_embeddings": max_positions, "tie_word_embeddings": tied, "sliding_window": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}


def _preset(model_type: str, text: dict, vision: dict, ids: dict, **extra) -> dict:
    architecture = {"llava": "LlavaForConditionalGeneration",
                    "llava_next": "LlavaNextForConditionalGeneration",
                    "llava_onevision": "LlavaOnevisionForConditionalGeneration"}[model_type]
    image_id, video_id, strategy, layer, _ = _FAMILY_DEFAULTS[model_type]
    config = {"architectures": [architecture], "model_type": model_type, "text_config": text,
              "vision_config": vision, "image_token_index": ids["image"],
              "vision_feature_select_strategy": strategy, "vision_feature_layer": layer,
              "projector_hidden_act": "gelu", "multimodal_projector_bias": True,
              "tie_word_embeddings": text["tie_word_embeddings"], **extra}
    if model_type == "llava_onevision":
        config["video_token_index"] = ids["video"]
    return config


def llava_presets(ids: dict) -> dict[str, dict]:
    """HF config dicts of the LLaVA presets; ids: the tiny tokenizer's bos / eos / pad /
    image / video token ids (real-shape presets run with that tokenizer and dummy weights)."""
    tiny_clip = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 3, "num_attention_heads": 4, "image_size": 56, "patch_size": 14}
    tiny_siglip = {**tiny_clip, "model_type": "siglip_vision_model", "vision_use_head": False}
    tiny_pinpoints = [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]

    def tiny_text(model_type: str) -> dict:
        return _preset_text(model_type, 512, 64, 2, 4, 2, 128, 10000.0, 4096, False, ids)

    llama_7b = _preset_text("llama", 32064, 4096, 32, 32, 32, 11008, 10000.0, 4096, False, ids)
    mistral_7b = _preset_text("mistral", 32064, 4096, 32, 32, 8, 14336, 1_000_000.0, 32768, False, ids)
    qwen2_0_5b = _preset_text("qwen2", 152000, 896, 24, 14, 2, 4864, 1_000_000.0, 32768, True, ids)
    return {
        "tiny-llava": _preset("llava", tiny_text("llama"), tiny_clip, ids),
        "tiny-llava-next": _preset("llava_next", tiny_text("llama"), tiny_clip, ids,
                                   image_grid_pinpoints=tiny_pinpoints),
        "tiny-llava-onevision": _preset("llava_onevision", tiny_text("qwen2"), tiny_siglip, ids,
                                        image_grid_pinpoints=tiny_pinpoints,
                                        vision_aspect_ratio="anyres_max_4"),
        # llava-hf/llava-1.5-7b-hf, llava-hf/llava-v1.6-mistral-7b-hf,
        # llava-hf/llava-onevision-qwen2-0.5b-ov-hf shapes.
        "llava-1.5-7b": _preset("llava", llama_7b, _CLIP_336, ids),
        "llava-next-7b": _preset("llava_next", mistral_7b, _CLIP_336, ids,
                                 image_grid_pinpoints=[list(p) for p in _NEXT_PINPOINTS]),
        "llava-onevision-0.5b": _preset("llava_onevision", qwen2_0_5b, _SIGLIP_384, ids,
                                        image_grid_pinpoints=[list(p) for p in _ONEVISION_PINPOINTS],
                                        vision_aspect_ratio="anyres_max_9"),
    }
