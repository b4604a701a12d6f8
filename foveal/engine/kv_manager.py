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

With KV cache groups (foveal/engine/kv_groups.py: a model with sliding-window
layers) every request holds one table per group, all of one length. A sliding
group's table entries before its window are given back before each step (the
null block takes their place), and a prefix hit there needs only the blocks of
the last window before the hit: each group's cached blocks are keyed by
(group, hash), one LRU free list serves them all. The offload tier keeps a
group's blocks under the hash with the group appended (`tier_key`): a block
holds that group's layers only.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

from foveal.engine.kv_groups import KVCacheGroups
from foveal.engine.kv_offload import KVConnector
from foveal.engine.request import Request


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple) -> bytes:
    """Prefix hash of one full block, chained to its parent block's hash."""
    payload = repr((tuple(token_ids), extra_keys)).encode()
    return hashlib.sha256((parent or b"") + payload).digest()


def tier_key(group: int, block_hash: bytes) -> bytes:
    """The offload tier's name for a group's block: group 0 keeps the bare hash."""
    return block_hash if group == 0 else block_hash + bytes([group])


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
                 offload: KVConnector | None = None, groups: KVCacheGroups | None = None):
        """groups: how layers share pages (None: one group, every layer in every block)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = groups or KVCacheGroups.single(0)
        self.num_groups = self.groups.num_groups
        self.offload = offload if enable_prefix_caching else None
        # The null block stands in a sliding group's table for blocks given back.
        self.null_block: int | None = 0 if self.groups.is_hybrid else None
        self._ref_counts = [0] * num_blocks
        self._block_keys: list[tuple[int, bytes] | None] = [None] * num_blocks  # (group, hash)
        # Free blocks, LRU first; hashed ones are still prefix-cache hits.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(
            b for b in range(num_blocks) if b != self.null_block)
        self._cached: dict[tuple[int, bytes], int] = {}
        self._tables: dict[str, list[list[int]]] = {}  # per group, equal lengths
        # Leading blocks of a table already registered (or skipped) in _cached.
        self._num_registered: dict[str, int] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1); cached free blocks count as free."""
        return 1.0 - len(self._free) / max(self.num_usable_blocks, 1)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's table of group 0 (full attention)."""
        tables = self._tables.get(request_id)
        return list(tables[0]) if tables else []

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's table in every group (the null block where given back)."""
        return [list(t) for t in self._tables.get(request_id, [[]] * self.num_groups)]

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def pages_needed(self, num_tokens: int, step_tokens: int) -> int:
        """Blocks one request of num_tokens holds at most, all groups together."""
        return self.groups.pages_needed(num_tokens, step_tokens, self.block_size)

    def longest_request(self, step_tokens: int) -> int:
        """Tokens of the longest request the empty pool holds, computed in steps of
        up to step_tokens (with sliding groups more than num_tokens / num_groups)."""
        low, high = 0, self.num_usable_blocks * self.block_size
        while low < high:
            middle = (low + high + 1) // 2
            if self.pages_needed(middle, step_tokens) <= self.num_usable_blocks:
                low = middle
            else:
                high = middle - 1
        return low

    def get_computed_blocks(self, request: Request
                            ) -> tuple[list[list[int | None]], int]:
        """Longest cached prefix of a request that holds no blocks yet.

        Capped so at least one token is left to compute: the last known token
        must run through the model to give logits. Returns (per group, the hit's
        blocks: a pool block id, or None for one the offload tier holds, which
        allocate_slots loads into a fresh block; tokens). In a sliding group the
        blocks before the window of the first token computed are the null
        block: only the last window must be cached there.
        """
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return [[] for _ in range(self.num_groups)], 0
        self._update_block_hashes(request)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        num_hit = 0
        while num_hit < len(hashes) and self._holds(0, hashes[num_hit]):
            num_hit += 1
        num_hit = self._window_hits(hashes, num_hit)
        hits = [[self._cached.get((g, hashes[i])) if i >= first else self.null_block
                 for i in range(num_hit)]
                for g, first in enumerate(self._first_live_blocks(num_hit * self.block_size))]
        return hits, num_hit * self.block_size

    def _holds(self, group: int, block_hash: bytes) -> bool:
        """Whether the pool, or else the offload tier, has this group's block."""
        return (group, block_hash) in self._cached or (
            self.offload is not None and self.offload.contains(tier_key(group, block_hash)))

    def _window_hits(self, hashes: list[bytes], num_hit: int) -> int:
        """The longest hit of at most num_hit blocks whose windows every sliding
        group holds: its blocks from the first one the window reads to the hit's end."""
        changed = self.groups.is_hybrid
        while changed and num_hit:
            changed = False
            for group in range(1, self.num_groups):
                while num_hit and not all(
                        self._holds(group, hashes[i]) for i in range(
                            self.groups.first_live_block(group, num_hit * self.block_size,
                                                         self.block_size), num_hit)):
                    num_hit -= 1
                    changed = True
        return num_hit

    def _first_live_blocks(self, first_query: int) -> list[int]:
        return [self.groups.first_live_block(g, first_query, self.block_size)
                for g in range(self.num_groups)]

    def allocate_slots(
        self, request: Request, num_new_tokens: int,
        computed_blocks: list[list[int]] | None = None) -> list[list[int]] | None:
        """Grow the request's tables to hold num_new_tokens more tokens.

        computed_blocks (from get_computed_blocks, called just before) is only
        for a request with no blocks and num_computed_tokens == 0; its blocks the
        offload tier holds (None) are loaded into fresh blocks. A running
        request's sliding groups first give back the blocks before the window of
        its next token. Returns the block ids appended to each group's table, or
        None — allocating nothing — if the pool is too small.
        """
        tables = self._tables.get(request.request_id)
        if tables is not None:
            self.release_outside_windows(request)
        else:
            tables = [[] for _ in range(self.num_groups)]
        computed = computed_blocks or [[] for _ in range(self.num_groups)]
        num_hit_blocks = len(computed[0])
        num_tokens = request.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(num_tokens) - len(tables[0]) - num_hit_blocks)
        hit_ids = [b for group in computed for b in group if b is not None and b != self.null_block]
        loads = [(g, i) for g, group in enumerate(computed) for i, b in enumerate(group) if b is None]
        num_free_hits = sum(1 for b in hit_ids if self._ref_counts[b] == 0)
        if num_new_blocks * self.num_groups + len(loads) > len(self._free) - num_free_hits:
            return None
        for block_id in hit_ids:
            self._take_cached(block_id)
        hashes = request.block_hashes
        if loads:  # before any eviction below could drop them from the tier
            self.offload.pin([tier_key(g, hashes[i]) for g, i in loads])
        appended = []
        for group, table in enumerate(tables):
            new_blocks = list(computed[group])
            for index, block_id in enumerate(new_blocks):
                if block_id is None:
                    new_blocks[index] = block_id = self._take_free()
                    self.offload.load(tier_key(group, hashes[index]), block_id)
                    self._block_keys[block_id] = (group, hashes[index])
                    self._cached[(group, hashes[index])] = block_id
            new_blocks += [self._take_free() for _ in range(num_new_blocks)]
            table.extend(new_blocks)
            appended.append(new_blocks)
        self._tables[request.request_id] = tables
        if num_hit_blocks:
            self._num_registered[request.request_id] = num_hit_blocks
        return appended

    def release_outside_windows(self, request: Request) -> None:
        """Give back sliding groups' blocks that no query from the request's next
        token (num_computed_tokens) on reads."""
        tables = self._tables[request.request_id]
        for group, first in enumerate(self._first_live_blocks(request.num_computed_tokens)):
            table = tables[group]
            for index in range(min(first, len(table))):
                self._release(table[index])
                table[index] = self.null_block

    def cache_full_blocks(self, request: Request) -> None:
        """Register hashes of blocks the request has fully computed."""
        if not self.enable_prefix_caching:
            return
        tables = self._tables.get(request.request_id)
        if tables is None:
            return
        # A stop inside an accepted run can leave computed KV past the last kept token.
        num_computed = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(num_computed // self.block_size, len(tables[0]))
        self._update_block_hashes(request)
        start = self._num_registered.get(request.request_id, 0)
        for group, table in enumerate(tables):
            for index in range(start, num_full):
                block_id, key = table[index], (group, request.block_hashes[index])
                # An identical block computed by another request keeps the entry.
                if (block_id != self.null_block and self._block_keys[block_id] is None
                        and key not in self._cached):
                    self._block_keys[block_id] = key
                    self._cached[key] = block_id
        self._num_registered[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Drop the request's references; unshared blocks return to the pool."""
        tables = self._tables.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        # Tail blocks first, so a prefix chain is evicted from its end.
        for table in tables:
            for block_id in reversed(table):
                self._release(block_id)

    def trim(self, request: Request, num_tokens: int) -> int:
        """Give back the trailing blocks the request's first num_tokens do not
        reach (slots of rejected drafts); returns how many each table dropped."""
        tables = self._tables.get(request.request_id, [])
        keep = self.blocks_needed(num_tokens)
        num_trimmed = 0
        for table in tables:
            trailing = table[keep:]
            del table[keep:]
            num_trimmed = len(trailing)
            for block_id in reversed(trailing):
                self._release(block_id)
        registered = self._num_registered.get(request.request_id)
        if registered is not None:
            self._num_registered[request.request_id] = min(registered, keep)
        return num_trimmed

    def _release(self, block_id: int) -> None:
        """Drop one reference; the null block (held by no one) is skipped."""
        if block_id == self.null_block:
            return
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free[block_id] = None
            if self._block_keys[block_id] is None:
                # Holds nothing reusable: hand it out before cached blocks.
                self._free.move_to_end(block_id, last=False)

    def _take_cached(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        key = self._block_keys[block_id]
        if key is not None:
            if self._cached.get(key) == block_id:
                del self._cached[key]
                if self.offload is not None:
                    self.offload.on_evict(tier_key(*key), block_id)
            self._block_keys[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        for index in range(len(hashes), num_full):
            start, end = index * self.block_size, (index + 1) * self.block_size
            parent = hashes[-1] if hashes else None
            extra = block_extra_keys(request, start, end)
            hashes.append(hash_block(parent, request.all_token_ids[start:end], extra))
