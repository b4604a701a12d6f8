"""Preprocessing stages (PDF, OCR, speech-to-text), each in its own worker pool.

Stages are registry entries: name -> "module:Class", imported only when a pool
or a worker needs them, so `import foveal.stages` loads no model library.
Worker processes receive the "module:Class" string, not the class, so a
stage registered by a plugin or a test works in spawned workers too.

Importing this package also registers the "whisper" transcriber (in-process
faster-whisper) with `foveal.multimodal.transcriber`.
"""
from __future__ import annotations

import importlib

from foveal.errors import ConfigError

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
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def _whisper_transcriber():
    from foveal.stages.asr import WhisperTranscriber

    return WhisperTranscriber()


def _register_transcribers() -> None:
    from foveal.multimodal.transcriber import register_transcriber

    register_transcriber("whisper", _whisper_transcriber)


_register_transcribers()


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
