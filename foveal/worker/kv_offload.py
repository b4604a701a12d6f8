"""Worker half of the KV offload tier: copies blocks between the pool and a store.

The scheduler half (foveal/engine/kv_offload.py) decides what to copy; this
half applies a `KVTransferPlan` to the KV tensors before the forward: saves,
then loads, then drops. A block's KV across all layers is one tensor
(num_layers, 2, block_size, num_kv_heads, head_dim), kept in a store chosen by
name from BLOCK_STORES ("cpu": RAM, "disk": one file per block hash).
"""
from __future__ import annotations

import pathlib
from typing import Callable, Protocol

import torch

from foveal.config import CacheConfig
from foveal.engine.plan import KVTransferPlan
from foveal.errors import ConfigError


class BlockStore(Protocol):
    def put(self, block_hash: str, kv: torch.Tensor) -> None: ...

    def get(self, block_hash: str) -> torch.Tensor: ...

    def delete(self, block_hash: str) -> None: ...


class CPUBlockStore:
    """Blocks in host RAM, plain (uncompressed) tensors."""

    def __init__(self, cache_config: CacheConfig) -> None:
        self._blocks: dict[str, torch.Tensor] = {}

    def put(self, block_hash: str, kv: torch.Tensor) -> None:
        self._blocks[block_hash] = kv

    def get(self, block_hash: str) -> torch.Tensor:
        return self._blocks[block_hash]

    def delete(self, block_hash: str) -> None:
        self._blocks.pop(block_hash, None)


class DiskBlockStore:
    """Blocks as files <kv_offload_path>/<hash>.pt."""

    def __init__(self, cache_config: CacheConfig) -> None:
        if not cache_config.kv_offload_path:
            raise ConfigError("kv_offload='disk' needs kv_offload_path (--kv-offload-path)")
        self.root = pathlib.Path(cache_config.kv_offload_path)
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, block_hash: str, kv: torch.Tensor) -> None:
        torch.save(kv, self.root / f"{block_hash}.pt")

    def get(self, block_hash: str) -> torch.Tensor:
        return torch.load(self.root / f"{block_hash}.pt", weights_only=True)

    def delete(self, block_hash: str) -> None:
        (self.root / f"{block_hash}.pt").unlink(missing_ok=True)


BLOCK_STORES: dict[str, Callable[[CacheConfig], BlockStore]] = {
    "cpu": CPUBlockStore,
    "disk": DiskBlockStore,
}


class KVOffloadWorker:
    def __init__(self, store: BlockStore, kv_caches: list[torch.Tensor]) -> None:
        self.store = store
        self.kv_caches = kv_caches  # per layer (2, num_blocks, block_size, heads, head_dim)

    @classmethod
    def from_config(cls, cache_config: CacheConfig,
                    kv_caches: list[torch.Tensor]) -> "KVOffloadWorker":
        return cls(BLOCK_STORES[cache_config.kv_offload](cache_config), kv_caches)

    def apply(self, transfer: KVTransferPlan) -> None:
        if transfer.saves:
            self._save(transfer.saves)
        if transfer.loads:
            self._load(transfer.loads)
        for block_hash in transfer.drops:
            self.store.delete(block_hash)

    def _save(self, saves: list[tuple[str, int]]) -> None:
        ids = torch.tensor([block_id for _, block_id in saves], device=self.kv_caches[0].device)
        blocks = torch.stack([kv.index_select(1, ids) for kv in self.kv_caches])  # (L, 2, n, bs, H, D)
        blocks = blocks.to("cpu").transpose(0, 2)  # (n, 2, L, bs, H, D)
        for index, (block_hash, _) in enumerate(saves):
            self.store.put(block_hash, blocks[index].transpose(0, 1).contiguous())  # (L, 2, bs, H, D)

    def _load(self, loads: list[tuple[str, int]]) -> None:
        device = self.kv_caches[0].device
        ids = torch.tensor([block_id for _, block_id in loads], device=device)
        blocks = torch.stack([self.store.get(h) for h, _ in loads], dim=2)  # (L, 2, n, bs, H, D)
        blocks = blocks.to(device, non_blocking=True)
        for layer, kv in enumerate(self.kv_caches):
            kv.index_copy_(1, ids, blocks[layer].to(kv.dtype))
