"""Per-family media processing, looked up by HF model_type (imported lazily).

Each entry names a `ProcessorFamily` object as "package.module:NAME"; the
module (and torch with it) is imported on first lookup.
"""
from __future__ import annotations

from foveal.errors import ConfigError
from foveal.lazy_import import resolve
from foveal.multimodal.processors.family import ProcessorFamily

_QWEN2_VL = "foveal.multimodal.processors.qwen2_vl_family:QWEN2_VL"
# model_type -> family; Qwen2.5-VL media is processed like Qwen2-VL's.
_FAMILIES: dict[str, str] = {
    "qwen2_vl": _QWEN2_VL,
    "qwen2_5_vl": _QWEN2_VL,
    "qwen3_vl": "foveal.multimodal.processors.qwen3_vl_family:QWEN3_VL",
    "qwen3_vl_moe": "foveal.multimodal.processors.qwen3_vl_family:QWEN3_VL",
    "gemma3": "foveal.multimodal.processors.gemma3_family:GEMMA3",
    **dict.fromkeys(("llava", "llava_next", "llava_onevision"),
                    "foveal.multimodal.processors.llava_family:LLAVA"),
    "idefics3": "foveal.multimodal.processors.idefics3_family:IDEFICS3",
    "smolvlm": "foveal.multimodal.processors.idefics3_family:SMOLVLM",
}


def register_processor_family(model_type: str, target: str) -> None:
    """Add or replace a family: `target` is "package.module:NAME" of a ProcessorFamily."""
    _FAMILIES[model_type] = target


def get_processor_family(model_type: str) -> ProcessorFamily:
    """The media processing of an HF model_type, e.g. "qwen2_vl"."""
    if model_type not in _FAMILIES:
        raise ConfigError(f"no media processors for model_type {model_type!r}; "
                          f"supported: {sorted(_FAMILIES)}")
    return _load(_FAMILIES[model_type])


def get_processor_class(modality: str, model_type: str) -> type:
    """The `modality` processor class for an HF model_type, e.g. ("image", "qwen2_vl")."""
    if model_type not in _FAMILIES or modality not in ("image", "video"):
        supported = sorted(_FAMILIES) if modality in ("image", "video") else []
        raise ConfigError(f"no {modality} processor for model_type {model_type!r}; "
                          f"supported: {supported}")
    family = _load(_FAMILIES[model_type])
    return family.image_processor_class if modality == "image" else family.video_processor_class


def get_image_processor_class(model_type: str) -> type:
    return get_processor_class("image", model_type)


def get_video_processor_class(model_type: str) -> type:
    return get_processor_class("video", model_type)


def _load(target: str) -> ProcessorFamily:
    return resolve(target)
