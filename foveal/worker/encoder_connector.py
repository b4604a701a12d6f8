"""Worker half of an encoder-output connector: moves embeddings by mm_hash.

The scheduler half (foveal/engine/encoder_connector.py) plans; this half loads
planned items into the encoder cache before the step's encoder runs and
saves freshly encoded items after it.
"""
from __future__ import annotations

from typing import Protocol

import torch

from foveal.engine.plan import EncoderTransferPlan
from foveal.worker.encoder_runner import EncoderCache


class EmbeddingStore(Protocol):
    def __contains__(self, mm_hash: str) -> bool: ...

    def get(self, mm_hash: str) -> torch.Tensor: ...

    def put(self, mm_hash: str, embeddings: torch.Tensor) -> None: ...


class InProcessEmbeddingStore:
    """Embeddings in this process's memory, shareable by engines in the process."""

    def __init__(self) -> None:
        self._embeddings: dict[str, torch.Tensor] = {}

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._embeddings

    def __len__(self) -> int:
        return len(self._embeddings)

    def get(self, mm_hash: str) -> torch.Tensor:
        return self._embeddings[mm_hash]

    def put(self, mm_hash: str, embeddings: torch.Tensor) -> None:
        self._embeddings[mm_hash] = embeddings.detach().to("cpu")


class EncoderConnectorWorker:
    def __init__(self, store: EmbeddingStore) -> None:
        self.store = store

    def load(self, transfer: EncoderTransferPlan, cache: EncoderCache,
             device: torch.device) -> None:
        for mm_hash in transfer.loads:
            cache.put(mm_hash, self.store.get(mm_hash).to(device))

    def save(self, transfer: EncoderTransferPlan, cache: EncoderCache) -> None:
        for mm_hash in transfer.saves:
            if mm_hash in cache:
                self.store.put(mm_hash, cache.get(mm_hash))
