"""Scheduler half of an encoder-output connector: a second source of embeddings.

Parallel to the KV connector (foveal/engine/kv_offload.py), keyed by mm_hash.
When a scheduled window needs a media item the workers' encoder cache lacks,
the scheduler asks the connector first: an item it `contains` is loaded into
the encoder cache instead of being encoded (no encoder compute budget used);
an item the workers do encode is offered to it (`on_encode`), and it may plan
a save. The plan carries both as an `EncoderTransferPlan`; the worker half
(foveal/worker/encoder_connector.py) moves the tensors.

This is the seam for disaggregated encoding: an encode worker fills a store
that prefill workers load from, and several engines can share one store.
"""
from __future__ import annotations

from typing import Container, Protocol

from foveal.engine.plan import EncoderTransferPlan


class EncoderConnector(Protocol):
    """What the scheduler asks of a second source of encoder outputs (ints and hashes only)."""

    def contains(self, mm_hash: str) -> bool:
        """Whether the workers can load this item's embeddings instead of encoding it."""

    def load(self, mm_hash: str) -> None:
        """Plan loading the item into the workers' encoder cache this step."""

    def on_encode(self, mm_hash: str) -> None:
        """The workers encode this item this step."""

    def take_transfers(self) -> EncoderTransferPlan:
        """Loads and saves planned since the last call."""


class EmbeddingStoreConnector:
    """Scheduler half over an embedding store several engines may share.

    `stored` answers membership for the store's keys (the worker half's store
    itself when both halves live in one process). Every encoded item is saved.
    """

    def __init__(self, stored: Container[str]) -> None:
        self.stored = stored
        self.num_loads = 0
        self.num_saves = 0
        self._pending = EncoderTransferPlan()

    def contains(self, mm_hash: str) -> bool:
        return mm_hash in self.stored

    def load(self, mm_hash: str) -> None:
        self._pending.loads.append(mm_hash)
        self.num_loads += 1

    def on_encode(self, mm_hash: str) -> None:
        if mm_hash not in self.stored and mm_hash not in self._pending.saves:
            self._pending.saves.append(mm_hash)
            self.num_saves += 1

    def take_transfers(self) -> EncoderTransferPlan:
        transfers, self._pending = self._pending, EncoderTransferPlan()
        return transfers
