"""Per-forward state, set by the model runner in a `with` block.

Attention layers read the batch layout and their KV cache from here, so model
files never thread cache or metadata arguments through their forward().
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from foveal.engine.kv_groups import KVCacheGroups


@dataclass
class AttentionMetadata:
    """Layout of one flattened batch of T new tokens from B requests.

    Request i owns query rows query_start_loc[i]:query_start_loc[i+1]; its
    context after this step is seq_lens[i] tokens (already computed + new), so
    its queries sit at context positions seq_lens[i] - num_new .. seq_lens[i]-1.

    slot_mapping:     (T,)   int64 flat slot (block_id * block_size + offset)
                             where each new token's K/V is written
    query_start_loc:  (B+1,) int32 cumulative query counts
    seq_lens:         (B,)   int32 context length per request after this step
    block_tables:     (B, max_blocks) int32, padded with 0
    max_query_len / max_seq_len: python ints for kernels that want them
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, for CPU reference kernels that loop over requests.
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Tensors a backend derives once per forward and reuses in every layer
    # (gather indices, masks), keyed by the backend.
    backend_cache: dict = field(default_factory=dict)
    # Per request, context ranges [start, end) whose tokens attend to each other
    # both ways (Gemma 3's image tokens); None: causal everywhere. The scheduler
    # never splits one over two steps, so a span's keys are all there.
    bidirectional_spans: list[list[tuple[int, int]]] | None = None
    # Split count of the decode kernel when it must stay fixed (a CUDA graph);
    # None: the kernel picks one from the shapes.
    decode_splits: int | None = None

    @classmethod
    def from_arrays(cls, slot_mapping: np.ndarray, query_start_loc: np.ndarray,
                    seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
                    device: torch.device) -> "AttentionMetadata":
        """The layout from host arrays: (T,) slots, (B+1,) query starts, (B,) context
        lengths, (B, max_blocks) block tables (block_table_array)."""
        def on_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        return cls(
            slot_mapping=on_device(slot_mapping),
            query_start_loc=on_device(query_start_loc.astype(np.int32)),
            seq_lens=on_device(seq_lens.astype(np.int32)),
            block_tables=on_device(block_tables),
            max_query_len=int(np.diff(query_start_loc).max()), max_seq_len=int(seq_lens.max()),
            block_size=block_size,
            query_start_loc_cpu=query_start_loc.tolist(), seq_lens_cpu=seq_lens.tolist())


def block_table_array(rows: list[list[int]]) -> np.ndarray:
    """Each request's block ids, right-padded with 0: (B, max_blocks) int32."""
    table = np.zeros((len(rows), max(len(row) for row in rows)), dtype=np.int32)
    for i, row in enumerate(rows):
        table[i, :len(row)] = row
    return table


def layer_metadata(groups: KVCacheGroups, group_metadata: list[AttentionMetadata]
                   ) -> list[AttentionMetadata] | None:
    """Per decoder layer, the layout over its KV cache group's tables; None with
    one group (attn_metadata then serves every layer)."""
    if not groups.is_hybrid:
        return None
    return [group_metadata[groups.group_of(layer)] for layer in range(groups.num_layers)]


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    # One entry per decoder layer, laid out as foveal/layers/attention/kv_spec.py says:
    # (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_caches: list[torch.Tensor]
    # Per layer, the scales stored beside quantized blocks; None for float caches.
    kv_scales: list[torch.Tensor] | None = None
    # True while a step runs over the decode graphs' static buffers (captured or not):
    # layers then keep their shapes fixed and read no device value on the host.
    static_shapes: bool = False
    # With KV cache groups, per decoder layer the layout over its group's block
    # tables (attn_metadata is group 0's); None: attn_metadata for every layer.
    layer_metadata: list[AttentionMetadata] | None = None
    # True when every row of the step is a generated token or a draft (decode and
    # speculative verify steps), none a prompt token.
    generated_rows: bool = False

    def metadata_for(self, layer_idx: int) -> AttentionMetadata | None:
        if self.layer_metadata is None:
            return self.attn_metadata
        return self.layer_metadata[layer_idx]


_current: ForwardContext | None = None


@contextmanager
def forward_context(attn_metadata: AttentionMetadata | None, kv_caches: list[torch.Tensor],
                    kv_scales: list[torch.Tensor] | None = None,
                    static_shapes: bool = False,
                    layer_metadata: list[AttentionMetadata] | None = None,
                    generated_rows: bool = False) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ForwardContext(attn_metadata, kv_caches, kv_scales,
                                                  static_shapes, layer_metadata, generated_rows)
    try:
        yield _current
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention layer called outside forward_context()")
    return _current


def generated_rows() -> bool:
    """Whether every row of the running step is a generated token or a draft (a decode or
    speculative verify step; ForwardContext.generated_rows); False outside any forward
    context."""
    return _current is not None and _current.generated_rows


def static_shapes() -> bool:
    """Whether the running step is a decode graph's (ForwardContext.static_shapes);
    False outside any forward context."""
    return _current is not None and _current.static_shapes
