"""Attention backends, as a registry with lazy imports.

A backend is a class `Backend(num_heads, num_kv_heads, head_dim, scale)` with
`forward(q, k, v, kv_cache, attn_metadata, kv_scales=None) -> (T, H*D)` that
writes the new K/V into the paged cache (layout: kv_spec.py; kv_scales beside
quantized blocks) and attends over each request's context. The CPU
reference is torch SDPA; on CUDA the default is "triton" (Triton paged decode,
SDPA's fused kernels for prefill) where Triton is installed, else "sdpa".
FOVEAL_ATTENTION_BACKEND=name overrides the default on every device.
Other backends register here and may become a device type's default.
"""
from __future__ import annotations

import importlib.util
import os

from foveal.errors import ConfigError
from foveal.layers.attention.layer import Attention
from foveal.lazy_import import resolve

# name -> "module:Class", imported on first use
_BACKENDS: dict[str, str] = {"sdpa": "foveal.layers.attention.sdpa:SdpaBackend",
                             "triton": "foveal.layers.attention.triton_backend:TritonBackend"}
# device type -> backend name used when none is requested
_DEVICE_DEFAULTS: dict[str, str] = {"cpu": "sdpa"}


def register_attention_backend(name: str, target: str, default_for: tuple[str, ...] = ()) -> None:
    """Register `target` ("package.module:Class") as backend `name`, and make it
    the default for the device types in `default_for`."""
    _BACKENDS[name] = target
    for device_type in default_for:
        _DEVICE_DEFAULTS[device_type] = name


def default_backend_name(device_type: str) -> str:
    """FOVEAL_ATTENTION_BACKEND when set, else the device type's default."""
    if os.environ.get("FOVEAL_ATTENTION_BACKEND"):
        return os.environ["FOVEAL_ATTENTION_BACKEND"]
    if device_type in _DEVICE_DEFAULTS:
        return _DEVICE_DEFAULTS[device_type]
    if device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "sdpa"


def get_attention_backend(device_type: str, name: str | None = None) -> type:
    name = name or default_backend_name(device_type)
    if name not in _BACKENDS:
        raise ConfigError(f"attention backend {name!r} is unknown; registered: {sorted(_BACKENDS)}")
    return resolve(_BACKENDS[name])


__all__ = ["Attention", "default_backend_name", "get_attention_backend",
           "register_attention_backend"]
