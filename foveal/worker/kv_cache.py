"""Paged KV cache tensors: sizing and allocation.

One tensor per decoder layer, (2, num_blocks, block_size, num_kv_heads,
head_dim): index 0 holds keys, 1 values. Slot s of the pool is block
s // block_size, offset s % block_size.
"""
from __future__ import annotations

import os

import torch

from foveal.config import CacheConfig, ModelConfig
from foveal.errors import ConfigError

_MIB = 1 << 20


def kv_cache_bytes_per_block(model_config: ModelConfig, block_size: int,
                             dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    text = model_config.text
    per_layer = 2 * block_size * text.num_key_value_heads * text.head_dim * dtype.itemsize
    return per_layer * text.num_hidden_layers


def num_blocks_for(memory_bytes: int, model_config: ModelConfig, block_size: int,
                   dtype: torch.dtype, max_model_len: int) -> int:
    """How many blocks fit in memory_bytes; at least one max_model_len request must fit."""
    block_bytes = kv_cache_bytes_per_block(model_config, block_size, dtype)
    num_blocks = memory_bytes // block_bytes
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ConfigError(
            f"the KV cache gets {memory_bytes / _MIB:.1f} MiB = {num_blocks} blocks of "
            f"{block_size} tokens, but one max_model_len={max_model_len} request needs "
            f"{needed} blocks = {needed * block_bytes / _MIB:.1f} MiB; raise "
            f"--kv-cache-memory-bytes to at least {needed * block_bytes} "
            "or lower --max-model-len")
    return int(num_blocks)


def allocate_kv_caches(num_blocks: int, block_size: int, model_config: ModelConfig,
                       dtype: torch.dtype, device: str | torch.device) -> list[torch.Tensor]:
    """One zeroed (2, num_blocks, block_size, num_kv_heads, head_dim) tensor per layer.

    Zeroed, not empty: kernels that read a whole block and mask the unused
    slots would turn garbage NaNs into NaN outputs (0 * NaN = NaN).
    """
    text = model_config.text
    shape = (2, num_blocks, block_size, text.num_key_value_heads, text.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device)
            for _ in range(text.num_hidden_layers)]


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
