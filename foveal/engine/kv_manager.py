"""Paged KV-cache bookkeeping: block pool, block tables, prefix-hash chain.

Blocks hold `block_size` tokens. A block that a request has fully computed is
registered under its prefix hash, sha256(parent hash, token ids, extra keys),
where the extra keys name every media item overlapping the block as
(mm_hash, block start - item offset) — so two different images behind the same
placeholder token ids never share KV — plus the request's cache_salt for the
first block (so tenants with different salts never share KV). Only full
blocks are hashed. Freed blocks keep their hash and stay hittable until the
pool reuses them: the free list is LRU, the least recently freed block goes
first. With an offload connector (foveal/engine/kv_offload.py) a reused hashed
block is offered to a second tier, and a hash the tier holds is a hit too: it
gets a fresh block that the workers fill before the forward.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

from foveal.engine.kv_offload import KVConnector
from foveal.engine.request import Request


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple) -> bytes:
    """Prefix hash of one full block, chained to its parent block's hash."""
    payload = repr((tuple(token_ids), extra_keys)).encode()
    return hashlib.sha256((parent or b"") + payload).digest()


def block_extra_keys(request: Request, start: int, end: int) -> tuple:
    """Keys besides token ids that decide the KV of tokens [start, end)."""
    keys: list[tuple] = [
        (f.mm_hash, start - f.placeholder.offset)
        for f in request.mm_features
        if f.placeholder.offset < end and f.placeholder.end > start
    ]
    if start == 0 and request.cache_salt is not None:
        keys.append(("cache_salt", request.cache_salt))
    return tuple(keys)


class KVCacheManager:
    """Owns which request holds which KV block; never touches tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 offload: KVConnector | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.offload = offload if enable_prefix_caching else None
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        # Free blocks, LRU first; hashed ones are still prefix-cache hits.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        # Leading blocks of a table already registered (or skipped) in _cached.
        self._num_registered: dict[str, int] = {}

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds when full."""
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1); cached free blocks count as free."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that holds no blocks yet.

        Capped so at least one token is left to compute: the last known token
        must run through the model to give logits. Returns (block ids in the
        pool, tokens); the tokens include blocks the offload tier holds next,
        which allocate_slots loads into fresh blocks.
        """
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        num_offloaded = len(self._offloaded_prefix(request, len(hits)))
        return hits, (len(hits) + num_offloaded) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Grow the request's table to hold num_new_tokens more tokens.

        computed_blocks (from get_computed_blocks, called just before) is only
        for a request with no blocks and num_computed_tokens == 0; the offload
        tier's part of that hit is loaded into the first new blocks. Returns the
        block ids appended to the table, or None — allocating nothing — if the
        pool is too small.
        """
        table = self._tables.get(request.request_id, [])
        computed = computed_blocks or []
        offloaded = [] if computed_blocks is None else self._offloaded_prefix(request, len(computed))
        num_hit_blocks = len(computed) + len(offloaded)
        num_tokens = request.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(num_tokens) - len(table) - len(computed))
        num_free_hits = sum(1 for b in computed if self._ref_counts[b] == 0)
        if num_new_blocks > len(self._free) - num_free_hits:
            return None
        for block_id in computed:
            self._take_cached(block_id)
        if offloaded:
            self.offload.pin(offloaded)
        new_blocks = computed + [self._take_free() for _ in range(num_new_blocks)]
        for block_hash, block_id in zip(offloaded, new_blocks[len(computed):]):
            self.offload.load(block_hash, block_id)
            self._block_hashes[block_id] = block_hash
            self._cached[block_hash] = block_id
        self._tables[request.request_id] = table + new_blocks
        if num_hit_blocks:
            self._num_registered[request.request_id] = num_hit_blocks
        return new_blocks

    def cache_full_blocks(self, request: Request) -> None:
        """Register hashes of blocks the request has fully computed."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id, [])
        # A stop inside an accepted run can leave computed KV past the last kept token.
        num_computed = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(num_computed // self.block_size, len(table))
        self._update_block_hashes(request)
        start = self._num_registered.get(request.request_id, 0)
        for index in range(start, num_full):
            block_id, block_hash = table[index], request.block_hashes[index]
            # An identical block computed by another request keeps the entry.
            if self._block_hashes[block_id] is None and block_hash not in self._cached:
                self._block_hashes[block_id] = block_hash
                self._cached[block_hash] = block_id
        self._num_registered[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Drop the request's references; unshared blocks return to the pool."""
        table = self._tables.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        # Tail blocks first, so a prefix chain is evicted from its end.
        for block_id in reversed(table):
            self._release(block_id)

    def trim(self, request: Request, num_tokens: int) -> list[int]:
        """Give back the trailing blocks the request's first num_tokens do not
        reach (slots of rejected drafts); returns the freed block ids."""
        table = self._tables.get(request.request_id, [])
        keep = self.blocks_needed(num_tokens)
        trailing = table[keep:]
        del table[keep:]
        registered = self._num_registered.get(request.request_id)
        if registered is not None:
            self._num_registered[request.request_id] = min(registered, keep)
        for block_id in reversed(trailing):
            self._release(block_id)
        return trailing

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free[block_id] = None
            if self._block_hashes[block_id] is None:
                # Holds nothing reusable: hand it out before cached blocks.
                self._free.move_to_end(block_id, last=False)

    def _take_cached(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block_hash = self._block_hashes[block_id]
        if block_hash is not None:
            if self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]
                if self.offload is not None:
                    self.offload.on_evict(block_hash, block_id)
            self._block_hashes[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id

    def _offloaded_prefix(self, request: Request, start: int) -> list[bytes]:
        """Hashes after the first `start` blocks that the tier (not the pool) holds."""
        if self.offload is None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes: list[bytes] = []
        for block_hash in request.block_hashes[start:max_blocks]:
            if block_hash in self._cached or not self.offload.contains(block_hash):
                break
            hashes.append(block_hash)
        return hashes

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        for index in range(len(hashes), num_full):
            start, end = index * self.block_size, (index + 1) * self.block_size
            parent = hashes[-1] if hashes else None
            extra = block_extra_keys(request, start, end)
            hashes.append(hash_block(parent, request.all_token_ids[start:end], extra))
