"""Registries name their entries "package.module:attr" and import them on first use."""
from __future__ import annotations

import importlib
from typing import Any


def resolve(target: str) -> Any:
    """"package.module:attr" -> the attribute, importing the module now."""
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)
