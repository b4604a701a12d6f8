"""Paged KV cache sizing: this rank's KVCacheSpec and the memory the pool may take.

The layout itself lives in foveal/layers/attention/kv_spec.py.
"""
from __future__ import annotations

import os

import torch

from foveal.config import CacheConfig, ModelConfig
from foveal.engine.kv_groups import kv_cache_groups
from foveal.errors import ConfigError
from foveal.layers.attention.kv_quant import (QUANTIZED_KV_DTYPES, canonical_kv_dtype,
                                              get_kv_codec)
from foveal.layers.attention.kv_spec import KVCacheSpec
from foveal.worker.device import torch_dtype


def kv_cache_spec(model_config: ModelConfig, cache_config: CacheConfig, model_dtype: str,
                  tp_size: int = 1) -> KVCacheSpec:
    """This rank's KV layout: KV heads split over tp_size ranks (replicated when
    there are fewer heads than ranks), stored in cache_config.kv_cache_dtype
    ("auto": the model's dtype; int8 / int4 / fp8_e4m3: quantized blocks
    with scales, kv_quant.py)."""
    text = model_config.text
    name = canonical_kv_dtype(cache_config.kv_cache_dtype)
    quantized = name in QUANTIZED_KV_DTYPES
    if quantized:
        get_kv_codec(name)  # ConfigError now if this torch cannot store it
    float_name = model_dtype if name == "auto" or quantized else name
    return KVCacheSpec(num_layers=text.num_hidden_layers, block_size=cache_config.block_size,
                       num_kv_heads=max(1, text.num_key_value_heads // tp_size),
                       head_dim=text.head_dim, dtype=torch_dtype(float_name),
                       quantization=name if quantized else None,
                       groups=kv_cache_groups(model_config, cache_config))


def available_kv_memory(cache_config: CacheConfig, device: str | torch.device) -> int:
    """Bytes the KV pool may take: kv_cache_memory_bytes when set, else a
    fraction of what the device has free now (call after loading weights)."""
    if cache_config.kv_cache_memory_bytes is not None:
        return cache_config.kv_cache_memory_bytes
    device = torch.device(device)
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes * cache_config.gpu_memory_utilization)
    if device.type == "cpu":
        return int(_cpu_available_bytes() * cache_config.cpu_kv_cache_fraction)
    raise ConfigError(f"cannot size a KV cache on device {device}; "
                      "set --kv-cache-memory-bytes")


def _cpu_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
