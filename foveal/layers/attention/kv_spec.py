"""One description of the paged KV cache: dtype, layout, bytes per block.

Sizing, allocation, the attention backends and every block copy (offload
tier, and later disaggregation transfers) read the layout from here, so a new
cache dtype or a per-block scale tensor changes one file.

Layout of one decoder layer (one rank):
    cache  (2, num_blocks, block_size, num_kv_heads, stored_head_dim)  0 keys, 1 values
    scales (2, num_blocks, block_size, num_kv_heads) float16, quantized dtypes only
Slot s of the pool is block s // block_size, offset s % block_size.
stored_head_dim is head_dim, or head_dim / 2 for packed int4 (kv_quant.py).

With KV cache groups (foveal/engine/kv_groups.py) the pool holds one such tensor
per slot of a page, not per layer: decoder layer l uses tensor slot_of(l), at the
block ids of its own group's table.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from foveal.engine.kv_groups import KVCacheGroups
from foveal.errors import ConfigError
from foveal.layers.attention.kv_quant import SCALE_DTYPE, KVCodec, get_kv_codec

_MIB = 1 << 20


@dataclass(frozen=True)
class KVCacheSpec:
    """What one rank's KV pool holds per block.

    num_kv_heads is this rank's share (tensor parallelism shards KV heads).
    dtype: the float dtype of an unquantized cache; ignored when
    `quantization` ("int8" | "int4" | "fp8_e4m3") names a codec, whose storage
    dtype holds the blocks and which stores one scale per token and head.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    quantization: str | None = None
    scale_dtype: torch.dtype = SCALE_DTYPE
    # How layers share pages; None: one group (a block holds every layer).
    groups: KVCacheGroups | None = None

    @property
    def layer_groups(self) -> KVCacheGroups:
        return self.groups or KVCacheGroups.single(self.num_layers)

    @property
    def num_tensors(self) -> int:
        """Cache tensors of the pool: one per layer a block (page) holds."""
        return self.layer_groups.num_slots

    @property
    def codec(self) -> KVCodec | None:
        return get_kv_codec(self.quantization) if self.quantization else None

    @property
    def dtype_name(self) -> str:
        return self.quantization or str(self.dtype).removeprefix("torch.")

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.codec.storage_dtype if self.quantization else self.dtype

    @property
    def has_scales(self) -> bool:
        return self.quantization is not None

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Per block and per K/V: one scale per token and head; () without scales."""
        return (self.block_size, self.num_kv_heads) if self.has_scales else ()

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """(block_size, num_kv_heads, stored_head_dim): one block of keys (or values)."""
        stored = self.codec.stored_dim(self.head_dim) if self.quantization else self.head_dim
        return (self.block_size, self.num_kv_heads, stored)

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, *self.block_shape)

    def scale_layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, *self.scale_shape)

    @property
    def block_bytes(self) -> int:
        """Bytes one block (page) takes across the layers it holds: keys, values and
        their scales."""
        per_layer = 2 * _numel(self.block_shape) * self.storage_dtype.itemsize
        if self.has_scales:
            per_layer += 2 * _numel(self.scale_shape) * self.scale_dtype.itemsize
        return per_layer * self.num_tensors

    def blocks_needed(self, max_model_len: int, step_tokens: int | None = None) -> int:
        """Blocks a pool needs for one max_model_len request computed in steps of up
        to step_tokens (default: all at once), a hybrid pool's null block included."""
        return self.layer_groups.pages_needed(max_model_len, step_tokens or max_model_len,
                                              self.block_size) + self.layer_groups.is_hybrid

    def num_blocks_for(self, memory_bytes: int, max_model_len: int,
                       step_tokens: int | None = None) -> int:
        """Blocks that fit in memory_bytes; one max_model_len request, computed in
        steps of up to step_tokens (default: all at once), must fit."""
        num_blocks = memory_bytes // self.block_bytes
        needed = self.blocks_needed(max_model_len, step_tokens)
        if num_blocks < needed:
            raise ConfigError(
                f"the KV cache gets {memory_bytes / _MIB:.1f} MiB = {num_blocks} blocks of "
                f"{self.block_size} tokens, but one max_model_len={max_model_len} request "
                f"needs {needed} blocks = {needed * self.block_bytes / _MIB:.1f} MiB; raise "
                f"--kv-cache-memory-bytes to at least {needed * self.block_bytes} "
                "or lower --max-model-len")
        return int(num_blocks)

    def allocate(self, num_blocks: int, device: str | torch.device) -> "KVCaches":
        """Zeroed caches (and scales) for every tensor of the pool.

        Zeroed, not empty: kernels that read a whole block and mask the unused
        slots would turn garbage NaNs into NaN outputs (0 * NaN = NaN).
        """
        layers = [torch.zeros(self.layer_shape(num_blocks), dtype=self.storage_dtype,
                              device=device) for _ in range(self.num_tensors)]
        scales = None
        if self.has_scales:
            scales = [torch.zeros(self.scale_layer_shape(num_blocks), dtype=self.scale_dtype,
                                  device=device) for _ in range(self.num_tensors)]
        return KVCaches(self, layers, scales)


@dataclass
class KVCaches:
    """One rank's KV pool: caches and, for quantized dtypes, scales; one tensor
    per layer, or with KV cache groups one per slot of a page."""

    spec: KVCacheSpec
    layers: list[torch.Tensor]  # per tensor spec.layer_shape(num_blocks)
    scales: list[torch.Tensor] | None = None  # per tensor spec.scale_layer_shape(num_blocks)

    @cached_property
    def by_layer(self) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(caches, scales) indexed by decoder layer, as the forward context takes them
        (views of the pool's tensors, derived once)."""
        groups = self.spec.layer_groups
        if not groups.is_hybrid:
            return self.layers, self.scales
        slots = [groups.slot_of(layer) for layer in range(groups.num_layers)]
        return ([self.layers[s] for s in slots],
                [self.scales[s] for s in slots] if self.scales else None)

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[1] if self.layers else 0

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def read_blocks(self, block_ids: list[int]) -> list[dict[str, torch.Tensor]]:
        """Copies of whole blocks on the host, one dict per block:
        "kv": (num_layers, 2, block_size, Hkv, D) and, with scales,
        "scales": (num_layers, 2, *scale_shape)."""
        gathered = self.read_stacked(block_ids)
        return [{name: t[:, :, index].contiguous() for name, t in gathered.items()}
                for index in range(len(block_ids))]

    def write_blocks(self, block_ids: list[int], blocks: list[dict[str, torch.Tensor]]) -> None:
        """Put blocks read by read_blocks (any rank's pool of the same spec) at block_ids."""
        self.write_stacked(block_ids, {name: torch.stack([block[name] for block in blocks], dim=2)
                                       for name in blocks[0]})

    def read_stacked(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """Host copies of blocks, stacked: "kv": (num_layers, 2, n, block_size, Hkv, D)
        and, with scales, "scales": (num_layers, 2, n, *scale_shape)."""
        ids = torch.tensor(block_ids, device=self.device)
        parts = {"kv": self.layers, "scales": self.scales or []}
        return {name: torch.stack([t.index_select(1, ids) for t in tensors]).to("cpu")
                for name, tensors in parts.items() if tensors}

    def write_stacked(self, block_ids: list[int], stacked: dict[str, torch.Tensor]) -> None:
        """Put blocks as read_stacked gives them at block_ids (a ValueError if
        they do not have this pool's layout)."""
        ids = torch.tensor(block_ids, device=self.device)
        parts = {"kv": self.layers, "scales": self.scales or []}
        if set(stacked) != {name for name, tensors in parts.items() if tensors}:
            raise ValueError(f"blocks hold {sorted(stacked)}; this KV pool needs "
                             f"{sorted(name for name, t in parts.items() if t)}")
        for name, tensors in parts.items():
            if not tensors:
                continue
            expected = (len(tensors), 2, len(block_ids), *tensors[0].shape[2:])
            if tuple(stacked[name].shape) != expected:
                raise ValueError(f"{name} blocks have shape {tuple(stacked[name].shape)}; this "
                                 f"KV pool needs {expected}")
            values = stacked[name].to(self.device, non_blocking=True)
            for layer, tensor in enumerate(tensors):
                _as_bits(tensor).index_copy_(1, ids, _as_bits(values[layer].to(tensor.dtype)))


def slot_view(layer_tensor: torch.Tensor) -> torch.Tensor:
    """(2, num_blocks, block_size, ...) -> (2, num_slots, ...), a view: a
    layer's cache (..., Hkv, stored_head_dim) or its scales (..., Hkv)."""
    return layer_tensor.flatten(1, 2)


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """A same-size integer view for dtypes some CPU kernels lack (float8)."""
    if tensor.is_floating_point() and tensor.element_size() == 1:
        return tensor.view(torch.uint8)
    return tensor


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
