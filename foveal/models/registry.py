"""HF architecture string -> model class, imported on first use."""
from __future__ import annotations

from foveal.errors import ConfigError
from foveal.lazy_import import resolve

# HF architecture -> "module:Class"
_MODELS: dict[str, str] = {
    "Qwen2VLForConditionalGeneration": "foveal.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration":
        "foveal.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
    "Gemma3ForConditionalGeneration": "foveal.models.gemma3:Gemma3ForConditionalGeneration",
    "Qwen3VLForConditionalGeneration": "foveal.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    # the same model: the decoder reads its sparse layers from the config
    "Qwen3VLMoeForConditionalGeneration": "foveal.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    "LlavaForConditionalGeneration": "foveal.models.llava:LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration": "foveal.models.llava_next:LlavaNextForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration":
        "foveal.models.llava_next:LlavaOnevisionForConditionalGeneration",
    "Idefics3ForConditionalGeneration": "foveal.models.idefics3:Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration": "foveal.models.idefics3:SmolVLMForConditionalGeneration",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ConfigError(f"architecture {architecture!r} is not supported; supported: "
                          f"{', '.join(supported_architectures())}")
    return resolve(_MODELS[architecture])
