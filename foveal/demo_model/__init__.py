"""The demo model: synthetic visual tasks (`tasks`), their encoding into model
inputs (`encode`), training (`train`, `foveal train-demo`) and the trained
checkpoint the package ships (`DEMO_MODEL_DIR`)."""
from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo_model"

DEMO_MODEL_NAME = "foveal-demo"


def default_model_dir() -> Path:
    """The shipped trained checkpoint (the default of `foveal demo`, `serve`,
    `chat` and `generate` when no model is given)."""
    from foveal.errors import CheckpointError

    if not (DEMO_MODEL_DIR / "config.json").exists():
        raise CheckpointError(
            f"the demo model is missing from {DEMO_MODEL_DIR}; reinstall the package, or "
            "train it with `foveal train-demo OUT` and copy OUT/model there")
    return DEMO_MODEL_DIR
