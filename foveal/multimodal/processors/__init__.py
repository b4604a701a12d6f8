"""Per-family media processors, looked up by HF model_type (imported lazily)."""
from __future__ import annotations

import importlib

from foveal.errors import ConfigError

# model_type -> (module, class); Qwen2.5-VL images are processed exactly like Qwen2-VL's.
_IMAGE_PROCESSORS: dict[str, tuple[str, str]] = {
    "qwen2_vl": ("foveal.multimodal.processors.qwen2_vl", "Qwen2VLImageProcessor"),
    "qwen2_5_vl": ("foveal.multimodal.processors.qwen2_vl", "Qwen2VLImageProcessor"),
}


def get_image_processor_class(model_type: str) -> type:
    """The image processor class for an HF model_type, e.g. "qwen2_vl"."""
    if model_type not in _IMAGE_PROCESSORS:
        raise ConfigError(
            f"no image processor for model_type {model_type!r}; supported: {sorted(_IMAGE_PROCESSORS)}"
        )
    module_name, class_name = _IMAGE_PROCESSORS[model_type]
    return getattr(importlib.import_module(module_name), class_name)
