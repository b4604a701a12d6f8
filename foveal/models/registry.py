"""HF architecture string -> model class, imported on first use."""
from __future__ import annotations

from foveal.errors import ConfigError
from foveal.lazy_import import resolve

# HF architecture -> "module:Class"
_MODELS: dict[str, str] = {
    "Qwen2VLForConditionalGeneration": "foveal.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration":
        "foveal.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ConfigError(f"architecture {architecture!r} is not supported; supported: "
                          f"{', '.join(supported_architectures())}")
    return resolve(_MODELS[architecture])
