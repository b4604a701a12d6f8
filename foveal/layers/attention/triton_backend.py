"""CUDA attention backend: Triton paged KV writes and split-K decode
(triton_decode.py), prefill chunks through torch SDPA in the 4-D layout its
fused CUDA kernels (flash, memory-efficient) take.

A step whose every request brings one token (AttentionMetadata.max_query_len
== 1) runs with no host-side layout at all: the decode kernel reads the block
tables and context lengths from the metadata's device tensors, which is what
lets the model runner capture such steps in CUDA graphs. Mixed steps take the
decode rows through the same kernel and the prefill rows through SDPA.
Quantized caches and pages the kernel cannot tile (block_size not a power of
two of at least 16, head_dim under 16) take the SDPA reference paths.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from foveal.forward_context import AttentionMetadata
from foveal.layers.attention.kv_spec import slot_view
from foveal.layers.attention.sdpa import SdpaBackend, StepLayout, _Prefill
from foveal.layers.attention.triton_decode import paged_decode, write_kv


def kernel_fits(kv_cache: torch.Tensor) -> bool:
    """Whether the Triton kernels tile this cache: (2, blocks, block_size, Hkv, D)."""
    block_size, head_dim = kv_cache.shape[2], kv_cache.shape[-1]
    return block_size >= 16 and block_size & (block_size - 1) == 0 and head_dim >= 16


class TritonBackend(SdpaBackend):
    layout_key = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, metadata: AttentionMetadata | None,
                kv_scales: torch.Tensor | None = None,
                static_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q (T, H*D), k/v (T, Hkv*D) -> (T, H*D)."""
        if (metadata is None or kv_scales is not None or kv_cache is None
                or kv_cache.numel() == 0 or not kernel_fits(kv_cache)):
            return super().forward(q, k, v, kv_cache, metadata, kv_scales, static_scales)
        if metadata.max_query_len == 1:  # every row decodes: no host layout
            write_kv(kv_cache, k, v, metadata.slot_mapping)
            return paged_decode(q, kv_cache, metadata.block_tables, metadata.seq_lens,
                                self.scale, self.sliding_window, metadata.decode_splits)
        return super().forward(q, k, v, kv_cache, metadata, kv_scales, static_scales)

    def _write(self, kv_cache, k, v, slot_mapping) -> None:
        num_tokens = k.shape[0]
        write_kv(kv_cache, k.reshape(num_tokens, -1), v.reshape(num_tokens, -1), slot_mapping)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, layout: StepLayout,
                metadata: AttentionMetadata) -> torch.Tensor:
        """q (Bd, H, D) -> (Bd, H, D)."""
        tables = metadata.block_tables.index_select(0, layout.decode_requests)
        out = paged_decode(q.reshape(q.shape[0], -1), kv_cache, tables,
                           layout.decode_lens.to(torch.int32), self.scale, self.sliding_window)
        return out.view_as(q)

    def _expanded(self, keys: torch.Tensor) -> torch.Tensor:
        """(n, Hkv, D) -> (1, H, n, D): the 4-D, head-expanded layout of the fused kernels."""
        if self.group > 1:
            keys = keys.repeat_interleave(self.group, dim=1)
        return keys.transpose(0, 1).unsqueeze(0)

    def _causal(self, q, k, v) -> torch.Tensor:
        """One fresh sequence: q (n, H, D), k/v (n, Hkv, D) -> (n, H, D)."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), self._expanded(k.to(q.dtype)),
            self._expanded(v.to(q.dtype)), is_causal=True, scale=self.scale)  # (1, H, n, D)
        return out[0].transpose(0, 1)

    def _with_context(self, q: torch.Tensor, kv_cache: torch.Tensor, prefill: _Prefill
                      ) -> torch.Tensor:
        """A chunk after cached context: q (n, H, D) at positions seq_len-n.. -> (n, H, D)."""
        num_new, seq_len = q.shape[0], prefill.seq_len
        slots = slot_view(kv_cache)  # (2, num_slots, Hkv, D)
        keys = self._expanded(slots[0].index_select(0, prefill.slots).to(q.dtype))  # (1, H, L, D)
        values = self._expanded(slots[1].index_select(0, prefill.slots).to(q.dtype))
        query_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device) <= query_pos.unsqueeze(-1)  # (n, L)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask[None, None],
            scale=self.scale)  # (1, H, n, D)
        return out[0].transpose(0, 1)
