"""How decoder layers share the KV pool's pages (the hybrid KV layout).

A model whose layers all attend to the full context keeps one group: a block id
names the same slot in every layer's cache. A model with sliding-window layers
(Gemma 3: five local layers per global one) splits its layers into groups of
one kind each, all of the same size; every group keeps its own block table per
request, and a block id (a page) of the pool holds one block of every layer of
the group that took it. So a page holds `num_slots` layers' blocks, layer l
reads and writes slot `slot_of[l]` of the pages in its group's table, and a
sliding group gives back the pages its window has left behind: their table
entries become the null page, which is never handed out and never written.

Torch-free: the scheduler's KV manager and the workers' cache layout both
read this, so they agree on which page holds what.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from foveal.config import CacheConfig, ModelConfig


@dataclass(frozen=True)
class KVCacheGroups:
    """windows[g]: group g's sliding window in tokens, None for full attention
    (group 0 is always a full-attention group); layers[g]: its decoder layers,
    slot i of a page holding layers[g][i]."""

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]

    @classmethod
    def single(cls, num_layers: int) -> "KVCacheGroups":
        """One full-attention group: every layer in every block (no eviction)."""
        return cls((None,), (tuple(range(num_layers)),))

    @classmethod
    def for_layers(cls, layer_windows: Sequence[int | None]) -> "KVCacheGroups":
        """Groups for layers with these windows (None: full attention).

        The group size is the number of full-attention layers, so a page of the
        full group wastes nothing; each window's layers fill groups of that size in
        layer order (the last one may leave slots empty). Without sliding layers,
        or without a full-attention layer to anchor the tables, one group."""
        full = tuple(i for i, window in enumerate(layer_windows) if window is None)
        if len(full) in (0, len(layer_windows)):
            return cls.single(len(layer_windows))
        size = len(full)
        windows: list[int | None] = [None]
        layers: list[tuple[int, ...]] = [full]
        for window in sorted({w for w in layer_windows if w is not None}):
            members = [i for i, w in enumerate(layer_windows) if w == window]
            for start in range(0, len(members), size):
                windows.append(window)
                layers.append(tuple(members[start:start + size]))
        return cls(tuple(windows), tuple(layers))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    @property
    def num_slots(self) -> int:
        """Layers one page holds (the largest group)."""
        return max(len(group) for group in self.layers)

    @property
    def num_layers(self) -> int:
        return sum(len(group) for group in self.layers)

    @cached_property
    def _layer_places(self) -> dict[int, tuple[int, int]]:
        """layer -> (group, slot), derived once: layers read it every forward."""
        return {layer: (group, slot) for group, members in enumerate(self.layers)
                for slot, layer in enumerate(members)}

    def group_of(self, layer: int) -> int:
        return self._layer_places[layer][0]

    def slot_of(self, layer: int) -> int:
        return self._layer_places[layer][1]

    def blocks_held(self, group: int, num_tokens: int, step_tokens: int, block_size: int) -> int:
        """Most blocks one request of num_tokens holds in a group while steps of
        up to step_tokens run: all of them in a full group; in a sliding group the
        window before a step's first token plus the step's own tokens."""
        blocks = -(-num_tokens // block_size)
        window = self.windows[group]
        if window is None:
            return blocks
        return min(blocks, (window - 1 + step_tokens) // block_size + 2)

    def pages_needed(self, num_tokens: int, step_tokens: int, block_size: int) -> int:
        """Pages one request of num_tokens holds at most, over all groups."""
        return sum(self.blocks_held(g, num_tokens, step_tokens, block_size)
                   for g in range(self.num_groups))

    def first_live_block(self, group: int, first_query: int, block_size: int) -> int:
        """The first block a step whose first query sits at position first_query
        reads in this group: 0 in a full group; in a sliding group the block of
        the oldest key the window still shows that query."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, first_query - window + 1) // block_size

    def describe(self) -> str:
        kinds = ["full" if w is None else f"window {w}" for w in self.windows]
        return (f"{self.num_groups} KV groups of {self.num_slots} layers "
                f"({', '.join(f'{k}: {list(layers)}' for k, layers in zip(kinds, self.layers))})")


def kv_cache_groups(model_config: ModelConfig, cache_config: CacheConfig) -> KVCacheGroups | None:
    """Groups for a model with sliding-window layers, unless cache_config turns
    them off; None: one group, every layer in every block."""
    windows = model_config.text.layer_windows
    if not any(windows) or cache_config.disable_hybrid_kv_cache_manager:
        return None
    groups = KVCacheGroups.for_layers([window or None for window in windows])
    return groups if groups.is_hybrid else None
