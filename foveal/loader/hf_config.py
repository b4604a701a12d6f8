"""HF config.json -> foveal.config.ModelConfig, once, at the edge.

Reads both layouts: transformers-5 nested `text_config` / `vision_config` with
`rope_parameters`, and the older flat one (text fields at top level,
`rope_scaling: {type: mrope, mrope_section}`, `rope_theta`).
"""
from __future__ import annotations

import json
import os

from foveal.config import CheckpointQuantization, ModelConfig, TextConfig, VisionConfig
from foveal.errors import ConfigError
from foveal.lazy_import import resolve
from foveal.models.registry import supported_architectures

_VISION_VARIANTS = {"Qwen2VLForConditionalGeneration": "qwen2_vl",
                    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
                    "Qwen3VLForConditionalGeneration": "qwen3_vl",
                    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl"}


# architecture -> "module:function" (hf dict, path, eos ids, stored dtype, checkpoint
# quantization) -> ModelConfig
_FAMILY_CONFIGS = {"Gemma3ForConditionalGeneration": "foveal.models.gemma3_config:gemma3_model_config"}
_FAMILY_CONFIGS.update(dict.fromkeys(
    ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
     "LlavaOnevisionForConditionalGeneration"), "foveal.models.llava_config:llava_model_config"))
_FAMILY_CONFIGS.update(dict.fromkeys(
    ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"),
    "foveal.models.idefics3_config:idefics3_model_config"))

def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _architecture(hf: dict) -> str:
    architectures = hf.get("architectures") or []
    for architecture in architectures:
        if architecture in supported_architectures():
            return architecture
    raise ConfigError(f"architectures {architectures} in config.json are not supported; supported: "
                      f"{', '.join(supported_architectures())}")


def _text_config(hf: dict) -> TextConfig:
    text = {**hf, **(hf.get("text_config") or {})}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    num_heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // num_heads
    section = tuple(rope.get("mrope_section") or ())
    if section and sum(section) != head_dim // 2:
        raise ConfigError(f"mrope_section {list(section)} sums to {sum(section)}; it must sum to "
                          f"head_dim // 2 = {head_dim // 2}")
    return TextConfig(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"], num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=text.get("num_key_value_heads") or num_heads,
        head_dim=head_dim, rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1_000_000.0))),
        mrope_section=section,
        max_position_embeddings=text.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings") or text.get("tie_word_embeddings")),
        hidden_act=text.get("hidden_act", "silu"),
        num_experts=int(text.get("num_experts") or text.get("num_local_experts") or 0),
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
        decoder_sparse_step=int(text.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(text.get("mlp_only_layers") or ()))


def _vision_config(vision: dict, variant: str, text_hidden: int) -> VisionConfig:
    if variant == "qwen2_vl":
        width = vision["embed_dim"]
        mlp_width = int(width * vision.get("mlp_ratio", 4))
        out_hidden = vision.get("hidden_size", text_hidden)
    else:
        width, mlp_width = vision["hidden_size"], vision["intermediate_size"]
        out_hidden = vision.get("out_hidden_size", text_hidden)
    return VisionConfig(
        variant=variant, depth=vision["depth"], hidden_size=width,
        num_heads=vision["num_heads"], intermediate_size=mlp_width, out_hidden_size=out_hidden,
        patch_size=vision.get("patch_size", 16 if variant == "qwen3_vl" else 14),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        in_channels=vision.get("in_channels", 3),
        hidden_act=vision.get("hidden_act", "quick_gelu" if variant == "qwen2_vl" else "silu"),
        window_size=vision.get("window_size", 0) if variant == "qwen2_5_vl" else 0,
        fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes") or ()),
        tokens_per_second=vision.get("tokens_per_second", 0) if variant == "qwen2_5_vl" else 0,
        **(_qwen3_vl_vision(vision) if variant == "qwen3_vl" else {}))


def _qwen3_vl_vision(vision: dict) -> dict:
    """Qwen3-VL's learned position table and DeepStack layers."""
    return {"num_position_embeddings": vision.get("num_position_embeddings", 2304),
            "deepstack_visual_indexes": tuple(vision.get("deepstack_visual_indexes") or ())}


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def model_config_from_dict(hf: dict, path: str | None = None,
                           generation_config: dict | None = None) -> ModelConfig:
    """Build a ModelConfig from an HF config dict (either layout)."""
    architecture = _architecture(hf)
    text_dict = hf.get("text_config") or {}
    eos = _as_ids((generation_config or {}).get("eos_token_id"))
    for value in (hf.get("eos_token_id"), text_dict.get("eos_token_id")):
        eos += tuple(i for i in _as_ids(value) if i not in eos)
    if architecture in _FAMILY_CONFIGS:  # families whose config.json reads differently
        return resolve(_FAMILY_CONFIGS[architecture])(hf, path, eos, _stored_dtype(hf, text_dict),
                                                      _checkpoint_quantization(hf))
    text = _text_config(hf)
    try:
        return ModelConfig(
            architecture=architecture, model_type=hf.get("model_type", ""), text=text,
            vision=_vision_config(hf["vision_config"], _VISION_VARIANTS[architecture], text.hidden_size),
            image_token_id=hf["image_token_id"], video_token_id=hf["video_token_id"],
            vision_start_token_id=hf["vision_start_token_id"],
            vision_end_token_id=hf["vision_end_token_id"],
            eos_token_ids=eos, path=path, checkpoint_dtype=_stored_dtype(hf, text_dict),
            checkpoint_quantization=_checkpoint_quantization(hf))
    except KeyError as missing:
        raise ConfigError(f"config.json lacks {missing}; re-export the checkpoint's config") from None


SUPPORTED_CHECKPOINT_QUANTIZATION = ("GPTQ (4 or 8 bits, checkpoint_format gptq or gptq_v2), "
                                     "AWQ (4 bits, version gemm) and fp8 (float8_e4m3fn weights "
                                     "with per-tensor, per-channel or block scales; also as "
                                     "compressed-tensors' float-quantized format)")


def _gptq(config: dict) -> CheckpointQuantization:
    bits, fmt = config.get("bits"), config.get("checkpoint_format", "gptq")
    if bits not in (4, 8):
        raise ConfigError(f"GPTQ checkpoint with bits={bits}; Foveal dequantizes 4- and 8-bit GPTQ")
    if fmt not in ("gptq", "gptq_v2") or config.get("is_marlin_format") or config.get("dynamic"):
        raise ConfigError(f"GPTQ checkpoint_format {fmt!r} (or marlin / per-module 'dynamic' "
                          "settings) cannot be loaded; Foveal reads the gptq and gptq_v2 layouts")
    return CheckpointQuantization("gptq", bits, int(config.get("group_size", -1)),
                                  zero_offset=1 if fmt == "gptq" else 0,
                                  requires_g_idx=bool(config.get("desc_act")))


def _awq(config: dict) -> CheckpointQuantization:
    bits, version = config.get("bits", config.get("w_bit")), str(config.get("version", "gemm"))
    if bits != 4 or version.lower() != "gemm" or config.get("zero_point", True) is False:
        raise ConfigError(f"AWQ checkpoint with bits={bits}, version={version!r}, zero_point="
                          f"{config.get('zero_point', True)}; Foveal reads 4-bit GEMM AWQ with zero points")
    return CheckpointQuantization("awq", 4, int(config.get("group_size", config.get("q_group_size", -1))))


def _fp8(config: dict) -> CheckpointQuantization:
    fmt = config.get("fmt", "e4m3")
    block = tuple(config.get("weight_block_size") or ())
    if fmt != "e4m3" or len(block) not in (0, 2):
        raise ConfigError(f"fp8 checkpoint with fmt={fmt!r}, weight_block_size={list(block)}; "
                          "Foveal reads e4m3 weights with 2-D blocks or no blocks")
    return CheckpointQuantization("fp8", 8, block_size=block)


def _compressed_tensors(config: dict) -> CheckpointQuantization:
    """compressed-tensors' "float-quantized" format: fp8 weights, the same tensors as fp8's."""
    weights = [group.get("weights") or {} for group in (config.get("config_groups") or {}).values()]
    fmt = config.get("format")
    fp8 = [w.get("num_bits") == 8 and w.get("type") == "float" for w in weights]
    blocks = {tuple(w.get("block_structure") or ()) for w in weights if w.get("strategy") == "block"}
    if fmt != "float-quantized" or not weights or not all(fp8) or len(blocks) > 1:
        raise ConfigError(f"compressed-tensors checkpoint in format {fmt!r} with weights "
                          f"{weights}; Foveal reads its float-quantized (fp8) weights only")
    return CheckpointQuantization("fp8", 8, block_size=next(iter(blocks), ()))


_CHECKPOINT_QUANTIZATION = {"gptq": _gptq, "awq": _awq, "fp8": _fp8,
                            "compressed-tensors": _compressed_tensors}


def _checkpoint_quantization(hf: dict) -> CheckpointQuantization | None:
    """config.json's quantization_config -> how the loader dequantizes, or None."""
    config = hf.get("quantization_config") or (hf.get("text_config") or {}).get(
        "quantization_config")
    if not config:
        return None
    method = str(config.get("quant_method", "?")).lower() if isinstance(config, dict) else "?"
    if method not in _CHECKPOINT_QUANTIZATION:
        raise ConfigError(f"this checkpoint is quantized ({method}), which Foveal cannot load; it "
                          f"loads {SUPPORTED_CHECKPOINT_QUANTIZATION} checkpoints, and float ones "
                          "(--quantization int8 quantizes those at load time)")
    return _CHECKPOINT_QUANTIZATION[method](config)


def _stored_dtype(hf: dict, text_dict: dict) -> str | None:
    """The weights' dtype as config.json names it (transformers 5: dtype; before: torch_dtype)."""
    for config in (hf, text_dict):
        for key in ("dtype", "torch_dtype"):
            if isinstance(config.get(key), str):
                return config[key].removeprefix("torch.")
    return None


def model_config_from_hf(path: str) -> ModelConfig:
    """Read `path`/config.json (and generation_config.json when present)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"{config_path} not found; pass a checkpoint folder holding config.json")
    generation_path = os.path.join(path, "generation_config.json")
    generation = _read_json(generation_path) if os.path.isfile(generation_path) else None
    return model_config_from_dict(_read_json(config_path), path=path, generation_config=generation)


# generation_config.json keys that become default SamplingParams fields.
_SAMPLING_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                      "min_p": "min_p"}


def default_sampling_overrides(path: str | None) -> dict:
    """SamplingParams defaults the checkpoint publishes (vLLM's
    generation_config="auto"): temperature/top_p/top_k/min_p, or greedy when
    the checkpoint says do_sample=false."""
    generation_path = os.path.join(path or "", "generation_config.json")
    if not path or not os.path.isfile(generation_path):
        return {}
    generation = _read_json(generation_path)
    if generation.get("do_sample") is False:
        return {"temperature": 0.0}
    return {ours: generation[key] for key, ours in _SAMPLING_DEFAULTS.items()
            if generation.get(key) is not None}
