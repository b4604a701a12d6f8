"""Preprocessing stages (PDF, OCR, speech-to-text), each in its own worker pool.

Stages are registry entries: name -> "module:Class", imported only when a pool
or a worker needs them, so `import foveal.stages` loads no model library.
Worker processes receive the "module:Class" string, not the class, so a
stage registered by a plugin or a test works in spawned workers too.
"""
from __future__ import annotations

from foveal.errors import ConfigError
from foveal.lazy_import import resolve

_STAGES: dict[str, str] = {
    "pdf": "foveal.stages.pdf:PdfStage",
    "ocr": "foveal.stages.ocr:OcrStage",
    "asr": "foveal.stages.asr:AsrStage",
}


def register_stage(name: str, target: str) -> None:
    """Add or replace a stage: `target` is "package.module:ClassName"."""
    _STAGES[name] = target


def stage_names() -> list[str]:
    return sorted(_STAGES)


def stage_target(name: str) -> str:
    if name not in _STAGES:
        raise ConfigError(f"unknown stage {name!r}; known stages: {stage_names()}")
    return _STAGES[name]


def load_stage_class(target: str) -> type:
    return resolve(target)


def __getattr__(name: str):
    # the public API, imported on first use
    if name == "StagePools":
        from foveal.stages.service import StagePools

        return StagePools
    if name == "StagesConfig":
        from foveal.stages.config import StagesConfig

        return StagesConfig
    if name == "expand_preprocessed_parts":
        from foveal.stages.assembly import expand_preprocessed_parts

        return expand_preprocessed_parts
    raise AttributeError(name)
