"""Worker half of the KV offload tier: copies blocks between the pool and a store.

The scheduler half (foveal/engine/kv_offload.py) decides what to copy; this
half applies a `KVTransferPlan` to the KV pool before the forward: saves,
then loads, then drops. A stored block is what `KVCaches.read_blocks` gives:
{"kv": (num_layers, 2, block_size, num_kv_heads, head_dim)} plus "scales" for
quantized caches, kept in a store chosen by name from BLOCK_STORES ("cpu":
RAM, "disk": one file per block hash).
"""
from __future__ import annotations

import pathlib
from typing import Callable, Protocol

import torch

from foveal.config import CacheConfig
from foveal.engine.plan import KVTransferPlan
from foveal.errors import ConfigError
from foveal.layers.attention.kv_spec import KVCaches

Block = dict[str, torch.Tensor]  # "kv" (and "scales"), as KVCaches.read_blocks gives


class BlockStore(Protocol):
    def put(self, block_hash: str, block: Block) -> None: ...

    def get(self, block_hash: str) -> Block: ...

    def delete(self, block_hash: str) -> None: ...


class CPUBlockStore:
    """Blocks in host RAM, plain (uncompressed) tensors."""

    def __init__(self, cache_config: CacheConfig) -> None:
        self._blocks: dict[str, Block] = {}

    def put(self, block_hash: str, block: Block) -> None:
        self._blocks[block_hash] = block

    def get(self, block_hash: str) -> Block:
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

    def put(self, block_hash: str, block: Block) -> None:
        torch.save(block, self.root / f"{block_hash}.pt")

    def get(self, block_hash: str) -> Block:
        return torch.load(self.root / f"{block_hash}.pt", weights_only=True)

    def delete(self, block_hash: str) -> None:
        (self.root / f"{block_hash}.pt").unlink(missing_ok=True)


BLOCK_STORES: dict[str, Callable[[CacheConfig], BlockStore]] = {
    "cpu": CPUBlockStore,
    "disk": DiskBlockStore,
}


class KVOffloadWorker:
    def __init__(self, store: BlockStore, kv_caches: KVCaches) -> None:
        self.store = store
        self.kv_caches = kv_caches

    @classmethod
    def from_config(cls, cache_config: CacheConfig, kv_caches: KVCaches) -> "KVOffloadWorker":
        return cls(BLOCK_STORES[cache_config.kv_offload](cache_config), kv_caches)

    def apply(self, transfer: KVTransferPlan) -> None:
        if transfer.saves:
            blocks = self.kv_caches.read_blocks([block_id for _, block_id in transfer.saves])
            for (block_hash, _), block in zip(transfer.saves, blocks):
                self.store.put(block_hash, block)
        if transfer.loads:
            self.kv_caches.write_blocks([block_id for _, block_id in transfer.loads],
                                        [self.store.get(h) for h, _ in transfer.loads])
        for block_hash in transfer.drops:
            self.store.delete(block_hash)
