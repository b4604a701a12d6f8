"""Resolve the device and dtype flags (`--device`, `--dtype`) to concrete values."""
from __future__ import annotations

import torch

from foveal.errors import ConfigError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES: tuple[str, ...] = tuple(_DTYPES)
# Checkpoint dtypes a CUDA run keeps as stored; anything else runs in bfloat16.
_CUDA_NATIVE = ("bfloat16", "float16")


def resolve_device(name: str) -> str:
    """"auto" | "cpu" | "cuda" | "cuda:N" -> a device string torch accepts."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu"
    if name == "cuda" or name.startswith("cuda:"):
        return _check_cuda(name)
    raise ConfigError(f"unknown device {name!r}; use one of auto, cpu, cuda, cuda:N (--device)")


def _check_cuda(name: str) -> str:
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but no CUDA device is available; "
                          "use --device cpu (or auto)")
    index = name.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise ConfigError(f"device {name!r}: there are {torch.cuda.device_count()} CUDA "
                          "devices; pick cuda:0 .. cuda:N-1 (--device)")
    return name


def resolve_dtype(name: str, device: str,
                  checkpoint_dtype: str | torch.dtype | None = None) -> str:
    """The dtype name (a key of EngineConfig.dtype) to run in.

    auto on CUDA: the checkpoint's half dtype, else bfloat16. auto on CPU: a
    bfloat16 checkpoint runs in bfloat16 where the CPU has bf16 instructions
    (foveal/cpu_features.py), everything else in float32 (without them
    bf16 matmuls are ~8x slower than fp32, and fp16 has no fast CPU path).
    """
    if name != "auto":
        if name not in _DTYPES:
            raise ConfigError(f"unknown dtype {name!r}; use one of auto, "
                              f"{', '.join(_DTYPES)} (--dtype)")
        return name
    stored = str(checkpoint_dtype).removeprefix("torch.") if checkpoint_dtype else None
    if not str(device).startswith("cuda"):
        from foveal.cpu_features import cpu_features

        return "bfloat16" if stored == "bfloat16" and cpu_features().native_bf16 else "float32"
    return stored if stored in _CUDA_NATIVE else "bfloat16"


def torch_dtype(name: str) -> torch.dtype:
    """A resolved dtype name (EngineConfig.dtype) -> torch.dtype."""
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)} (--dtype)")
    return _DTYPES[name]
