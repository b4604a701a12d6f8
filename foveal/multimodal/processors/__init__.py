"""Per-family media processors, looked up by modality and HF model_type (imported lazily)."""
from __future__ import annotations

import importlib

from foveal.errors import ConfigError

_QWEN2_VL = "foveal.multimodal.processors.qwen2_vl"
_QWEN2_VL_VIDEO = "foveal.multimodal.processors.qwen2_vl_video"
# (modality, model_type) -> (module, class); Qwen2.5-VL media is processed like Qwen2-VL's.
_PROCESSORS: dict[tuple[str, str], tuple[str, str]] = {
    ("image", "qwen2_vl"): (_QWEN2_VL, "Qwen2VLImageProcessor"),
    ("image", "qwen2_5_vl"): (_QWEN2_VL, "Qwen2VLImageProcessor"),
    ("video", "qwen2_vl"): (_QWEN2_VL_VIDEO, "Qwen2VLVideoProcessor"),
    ("video", "qwen2_5_vl"): (_QWEN2_VL_VIDEO, "Qwen2VLVideoProcessor"),
}


def get_processor_class(modality: str, model_type: str) -> type:
    """The `modality` processor class for an HF model_type, e.g. ("image", "qwen2_vl")."""
    if (modality, model_type) not in _PROCESSORS:
        supported = sorted(t for m, t in _PROCESSORS if m == modality)
        raise ConfigError(f"no {modality} processor for model_type {model_type!r}; "
                          f"supported: {supported}")
    module_name, class_name = _PROCESSORS[(modality, model_type)]
    return getattr(importlib.import_module(module_name), class_name)


def get_image_processor_class(model_type: str) -> type:
    return get_processor_class("image", model_type)


def get_video_processor_class(model_type: str) -> type:
    return get_processor_class("video", model_type)
