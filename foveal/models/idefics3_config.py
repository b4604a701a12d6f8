"""Idefics3 / SmolVLM config.json -> ModelConfig, torch-free.

Both families share one layout: a SigLIP-style `vision_config` (no class
token, post-LN), `scale_factor` (the connector's pixel shuffle) and a Llama
`text_config` (read by `llava_config.decoder_text_config`: default, linear or
llama3 RoPE; other scalings are a ConfigError). What only these families have is `Idefics3Settings`
(`ModelConfig.family_config`).
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from foveal.config import CheckpointQuantization, ModelConfig, VisionConfig
from foveal.errors import ConfigError
from foveal.models.llava_config import decoder_text_config

_ARCHITECTURES = {"idefics3": "Idefics3ForConditionalGeneration",
                  "smolvlm": "SmolVLMForConditionalGeneration"}
# transformers' Idefics3VisionConfig / SmolVLMVisionConfig defaults.
_VISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
                    "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 32,
                    "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}


@dataclass(frozen=True)
class Idefics3Settings:
    """What Idefics3 / SmolVLM need beyond TextConfig / VisionConfig."""

    scale_factor: int  # pixel shuffle: scale^2 neighbouring patches -> one token
    image_size: int  # the tower's square input side (one tile), pixels
    vision_layer_norm_eps: float

    def image_seq_len(self, patch_size: int) -> int:
        """Visual tokens per tile: (side / patch)^2 / scale^2."""
        return (self.image_size // patch_size) ** 2 // self.scale_factor ** 2


def idefics3_model_config(hf: dict, path: str | None, eos: tuple[int, ...], stored_dtype: str | None,
                          quantization: CheckpointQuantization | None) -> ModelConfig:
    model_type = hf.get("model_type", "idefics3")
    if model_type not in _ARCHITECTURES:
        raise ConfigError(f"model_type {model_type!r} is not Idefics3 / SmolVLM; "
                          f"supported: {sorted(_ARCHITECTURES)}")
    text_dict = {"model_type": "llama", "rms_norm_eps": 1e-5, **(hf.get("text_config") or {})}
    tied = bool(hf.get("tie_word_embeddings", text_dict.get("tie_word_embeddings", False)))
    text = decoder_text_config(text_dict, tied)
    vision = {**_VISION_DEFAULTS, **(hf.get("vision_config") or {})}
    scale = int(hf.get("scale_factor", 2))
    side, patch = int(vision["image_size"]), int(vision["patch_size"])
    if side % patch or (side // patch) % scale:
        raise ConfigError(f"vision image_size {side} must be a multiple of patch_size {patch} x "
                          f"scale_factor {scale} for the pixel shuffle")
    vision_config = VisionConfig(
        variant="siglip", depth=vision["num_hidden_layers"], hidden_size=vision["hidden_size"],
        num_heads=vision["num_attention_heads"], intermediate_size=vision["intermediate_size"],
        out_hidden_size=text.hidden_size, patch_size=patch, temporal_patch_size=1,
        spatial_merge_size=scale, in_channels=vision["num_channels"], hidden_act=vision["hidden_act"])
    settings = Idefics3Settings(scale_factor=scale, image_size=side,
                                vision_layer_norm_eps=float(vision["layer_norm_eps"]))
    return ModelConfig(
        architecture=hf.get("architectures", [_ARCHITECTURES[model_type]])[0], model_type=model_type,
        text=text, vision=vision_config, image_token_id=hf.get("image_token_id", 128257),
        video_token_id=_video_token_id(hf, path) if model_type == "smolvlm" else -1, vision_start_token_id=-1, vision_end_token_id=-1, eos_token_ids=eos,
        path=path, checkpoint_dtype=stored_dtype, checkpoint_quantization=quantization,
        family_config=settings)


def _video_token_id(hf: dict, path: str | None) -> int:
    """SmolVLM's video placeholder (transformers' processor replaces the text "<video>", or
    the tokenizer's `video_token`) as one token id of the checkpoint's tokenizer; -1 when
    the tokenizer has no such single token (videos are then refused with that reason)."""
    if "video_token_id" in hf:
        return int(hf["video_token_id"])
    if not path:
        return -1
    folder = pathlib.Path(path)
    configs = [_json(folder / name) for name in ("preprocessor_config.json", "processor_config.json",
                                                 "tokenizer_config.json")]
    token = next((c["video_token"] for c in configs if isinstance(c.get("video_token"), str)), "<video>")
    for token_id, entry in configs[2].get("added_tokens_decoder", {}).items():
        if entry.get("content") == token:
            return int(token_id)
    # tokenizer.json (larger) only when tokenizer_config.json does not list the token
    return next((int(entry["id"]) for entry in _json(folder / "tokenizer.json").get("added_tokens", [])
                 if entry.get("content") == token), -1)


def _json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _preset(model_type: str, text: dict, vision: dict, scale: int, ids: dict) -> dict:
    text = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": text.pop("theta"),
                                **text.pop("rope_scaling", {})},
            "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"], **text}
    vision = {"model_type": f"{model_type}_vision", **_VISION_DEFAULTS, **vision}
    return {"architectures": [_ARCHITECTURES[model_type]], "model_type": model_type,
            "text_config": text, "vision_config": vision, "scale_factor": scale,
            "image_token_id": ids["image"], "tie_word_embeddings": text["tie_word_embeddings"],
            "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}


def idefics3_presets(ids: dict) -> dict[str, dict]:
    """HF config dicts of the Idefics3 / SmolVLM presets; ids: the tiny tokenizer's
    bos / eos / pad / image token ids."""
    def llama(vocab, hidden, layers, heads, kv_heads, ffn, theta, max_positions, tied,
              rope_scaling=None) -> dict:
        return {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
                "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": ffn,
                "theta": theta, "max_position_embeddings": max_positions, "tie_word_embeddings": tied,
                "rope_scaling": rope_scaling or {}}

    # 64px tiles of 8px patches, scale 2: 16 tokens per tile.
    tiny_vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 2, "image_size": 64, "patch_size": 8}
    # HuggingFaceTB/SmolVLM-256M-Instruct's shapes (512px tiles, 64 tokens each).
    smolvlm_256m_vision = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                           "num_attention_heads": 12, "image_size": 512, "patch_size": 16}
    # HuggingFaceM4/Idefics3-8B-Llama3's shapes: SigLIP so400m (364px tiles, 169 tokens each)
    # and Llama 3.1 8B with its llama3 RoPE scaling.
    idefics3_8b_vision = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                          "num_attention_heads": 16, "image_size": 364, "patch_size": 14}
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    return {
        "idefics3-8b": _preset("idefics3", llama(128259, 4096, 32, 32, 8, 14336, 500000.0, 131072, False,
                                                 llama31), idefics3_8b_vision, 2, ids),
        "tiny-idefics3": _preset("idefics3", llama(512, 64, 2, 4, 2, 128, 10000.0, 4096, False),
                                 tiny_vision, 2, ids),
        "tiny-smolvlm": _preset("smolvlm", llama(512, 64, 2, 4, 2, 128, 10000.0, 4096, True),
                                tiny_vision, 2, ids),
        "smolvlm-256m": _preset("smolvlm", llama(49280, 576, 30, 9, 3, 1536, 100000.0, 8192, False),
                                smolvlm_256m_vision, 4, ids),
    }
