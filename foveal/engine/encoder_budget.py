"""Scheduler half of the encoder cache: which media embeddings the workers hold.

Capacity is counted in embedding rows (visual tokens). Entries are keyed by
mm_hash and remember the requests that still need them. An entry nobody
references stays cached (LRU) so a later request with the same media skips the
encoder; it is evicted only when space is needed, and its hash is then reported
once through take_freed() so the plan tells the workers to drop it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from foveal.errors import InvalidRequestError
from foveal.multimodal.inputs import MMFeature


@dataclass
class _Entry:
    size: int
    request_ids: set[str] = field(default_factory=set)


class EncoderBudget:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: dict[str, _Entry] = {}
        self._unreferenced: OrderedDict[str, None] = OrderedDict()  # LRU first
        self._freed: list[str] = []
        self.num_used = 0

    def check_fits(self, feature: MMFeature, encoder_compute_budget: int) -> None:
        """Admission check: an item the cache or one step can never hold is an error."""
        size = feature.num_encoder_tokens
        limits = [
            (self.capacity, "the encoder cache holds", "raise CacheConfig.encoder_cache_size (--encoder-cache-size)"),
            (encoder_compute_budget, "one step may encode",
             "raise SchedulerConfig.encoder_compute_budget (--encoder-compute-budget)"),
        ]
        for limit, what, fix in limits:
            if size > limit:
                raise InvalidRequestError(
                    f"{feature.modality} item has {size} visual tokens but {what} {limit}; "
                    f"{fix} or send it at a lower resolution")

    def has(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def holds(self, request_id: str, mm_hash: str) -> bool:
        entry = self._entries.get(mm_hash)
        return entry is not None and request_id in entry.request_ids

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_held_entries(self) -> int:
        """Entries some unfinished request still references (0 when idle)."""
        return len(self._entries) - len(self._unreferenced)

    def num_refs(self, mm_hash: str) -> int:
        entry = self._entries.get(mm_hash)
        return 0 if entry is None else len(entry.request_ids)

    def can_allocate(self, feature: MMFeature, compute_budget_left: int) -> bool:
        """Whether a new entry fits this step's encoder compute and the cache."""
        size = feature.num_encoder_tokens
        reclaimable = sum(self._entries[h].size for h in self._unreferenced)
        return size <= compute_budget_left and size <= self.capacity - self.num_used + reclaimable

    def allocate(self, request_id: str, feature: MMFeature) -> None:
        """Reference the item for the request, creating the entry if needed."""
        entry = self._entries.get(feature.mm_hash)
        if entry is None:
            self._evict_until_free(feature.num_encoder_tokens)
            entry = self._entries[feature.mm_hash] = _Entry(feature.num_encoder_tokens)
            self.num_used += entry.size
        entry.request_ids.add(request_id)
        self._unreferenced.pop(feature.mm_hash, None)

    def release(self, request_id: str, mm_hash: str) -> None:
        """The request consumed the item's range; keep the entry cached."""
        entry = self._entries.get(mm_hash)
        if entry is None or request_id not in entry.request_ids:
            return
        entry.request_ids.discard(request_id)
        if not entry.request_ids:
            self._unreferenced[mm_hash] = None

    def release_all(self, request_id: str) -> None:
        for mm_hash in [h for h, e in self._entries.items() if request_id in e.request_ids]:
            self.release(request_id, mm_hash)

    def take_freed(self) -> list[str]:
        """Hashes evicted since the last call (each reported once)."""
        freed = [h for h in dict.fromkeys(self._freed) if h not in self._entries]
        self._freed = []
        return freed

    def _evict_until_free(self, size: int) -> None:
        while self.capacity - self.num_used < size and self._unreferenced:
            mm_hash, _ = self._unreferenced.popitem(last=False)
            self.num_used -= self._entries.pop(mm_hash).size
            self._freed.append(mm_hash)
