"""Shared fixtures: tiny random-weight checkpoints built offline, once per session."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton builds its own @triton.jit library functions (tl.max, tl.sum, ...) when it is
    # first imported, interpretable only if TRITON_INTERPRET is set by then. Inductor (the
    # compiled decode tests) imports triton early, so the interpreted attention kernels
    # (test_triton_attention.py, which triton_decode.py sets this for on import) need it
    # set before any test runs, whatever the order.
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
