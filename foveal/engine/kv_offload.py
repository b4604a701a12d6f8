"""Scheduler half of the KV offload tier, behind a connector interface.

A hashed block the pool is about to reuse would lose a prefix-cache entry.
With a tier configured, the KV manager tells the connector "block B holding
hash H is evicted"; the connector decides to keep H (plan a save H <- B) within
its byte budget. On lookup, a hash missing from the pool but held by the tier
counts as a hit: the KV manager takes a fresh block B and the connector plans
"load H -> B", which the workers apply before the forward that reads B.

The connector plans, the worker half (foveal/worker/kv_offload.py) copies.
A disaggregation connector (prefill on one worker, decode on another) fits the
same interface: `contains` asks the remote peer, `load` plans a transfer into
a local block, and the copies cross in the same `KVTransferPlan`.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from foveal.engine.plan import KVTransferPlan


class KVConnector(Protocol):
    """What the KV manager asks of a second tier (scheduler side, ints only)."""

    def contains(self, block_hash: bytes) -> bool:
        """Whether the tier can fill a block with this hash's KV."""

    def pin(self, block_hashes: list[bytes]) -> None:
        """Keep these hashes until the next take_transfers (they are about to load)."""

    def load(self, block_hash: bytes, block_id: int) -> None:
        """Plan filling a freshly taken pool block from the tier."""

    def on_evict(self, block_hash: bytes, block_id: int) -> None:
        """The pool reuses a block that holds this hash's KV."""

    def take_transfers(self) -> KVTransferPlan:
        """Copies planned since the last call; the workers apply them this step."""


class OffloadTier:
    """LRU set of block hashes kept in a RAM or disk tier, capped in blocks."""

    def __init__(self, capacity_blocks: int, block_bytes: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.num_hits = 0  # blocks loaded back
        self.num_saves = 0
        self._stored: OrderedDict[bytes, None] = OrderedDict()  # LRU first
        self._pinned: set[bytes] = set()
        self._loading: dict[int, bytes] = {}  # block id -> hash, loads not yet taken
        self._pending = KVTransferPlan()

    @property
    def num_bytes_stored(self) -> int:
        return len(self._stored) * self.block_bytes

    def __len__(self) -> int:
        return len(self._stored)

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._stored

    def pin(self, block_hashes: list[bytes]) -> None:
        self._pinned.update(block_hashes)

    def load(self, block_hash: bytes, block_id: int) -> None:
        self._stored.move_to_end(block_hash)
        self._pinned.add(block_hash)
        self._loading[block_id] = block_hash
        self._pending.loads.append((block_hash.hex(), block_id))
        self.num_hits += 1

    def on_evict(self, block_hash: bytes, block_id: int) -> None:
        if self._loading.get(block_id) == block_hash:
            # Loaded this step but reused before any forward: nothing to save,
            # the tier still holds the hash (pinned).
            del self._loading[block_id]
            self._pending.loads.remove((block_hash.hex(), block_id))
            self.num_hits -= 1
            return
        if block_hash in self._stored:
            self._stored.move_to_end(block_hash)
            return
        if self.capacity_blocks == 0:
            return
        self._stored[block_hash] = None
        self._pending.saves.append((block_hash.hex(), block_id))
        self.num_saves += 1
        self._shrink()

    def take_transfers(self) -> KVTransferPlan:
        transfers, self._pending = self._pending, KVTransferPlan()
        self._pinned.clear()
        self._loading.clear()
        return transfers

    def _shrink(self) -> None:
        """Evict least recently used, unpinned hashes down to capacity."""
        while len(self._stored) > self.capacity_blocks:
            victim = next((h for h in self._stored if h not in self._pinned), None)
            if victim is None:
                return
            del self._stored[victim]
            pending_save = next((s for s in self._pending.saves if s[0] == victim.hex()), None)
            if pending_save is not None:
                self._pending.saves.remove(pending_save)  # never copied: nothing to drop
            else:
                self._pending.drops.append(victim.hex())
