"""Shared fixtures: tiny random-weight checkpoints built offline, once per session."""
from __future__ import annotations

import pytest

TINY_PRESETS = ("tiny-qwen2-vl", "tiny-qwen2.5-vl")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """preset name -> checkpoint folder (built lazily, once)."""
    from foveal.loader.tiny_model import build_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[str, str] = {}

    def get(preset: str) -> str:
        if preset not in built:
            built[preset] = str(build_checkpoint(root / preset, preset))
        return built[preset]

    return get
