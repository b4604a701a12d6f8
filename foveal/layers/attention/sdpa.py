"""CPU reference attention backend on torch scaled_dot_product_attention.

Decode requests (one new query) of a step run as one batched SDPA call over
their contexts gathered from the paged cache, padded and masked; prefill
chunks run one call per request.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from foveal.forward_context import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k/v (T, Hkv, D) at flat slots (T,) of kv_cache (2, blocks, bs, Hkv, D)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = k.to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = v.to(kv_cache.dtype)


def gather_context(kv_cache: torch.Tensor, block_tables: torch.Tensor,
                   num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """block_tables (B, >=nb) -> keys, values (B, Hkv, L, D) for the first
    L = nb * block_size context slots of each request."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-num_tokens // block_size)
    ids = block_tables[:, :num_blocks].long()  # (B, nb)
    keys = kv_cache[0][ids].flatten(1, 2)  # (B, nb*bs, Hkv, D)
    values = kv_cache[1][ids].flatten(1, 2)
    return keys.transpose(1, 2), values.transpose(1, 2)  # (B, Hkv, L, D)


class SdpaBackend:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale

    def _sdpa(self, q, k, v, mask=None, causal=False) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                              is_causal=causal, scale=self.scale,
                                              enable_gqa=self.num_heads != self.num_kv_heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, metadata: AttentionMetadata | None) -> torch.Tensor:
        """q (T, H*D), k/v (T, Hkv*D) -> (T, H*D)."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if metadata is None:
            out = self._sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=True)
            return out.transpose(0, 1).reshape(num_tokens, -1)  # (T, H*D)
        if kv_cache is not None and kv_cache.numel() > 0:
            write_kv(kv_cache, k, v, metadata.slot_mapping)
        out = torch.empty_like(q)  # (T, H, D)
        starts = metadata.query_start_loc_cpu or metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens_cpu or metadata.seq_lens.tolist()
        decodes = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
        if decodes:
            self._decode(q, kv_cache, metadata, out, [starts[i] for i in decodes],
                         decodes, [seq_lens[i] for i in decodes])
        for i in range(len(seq_lens)):
            if starts[i + 1] - starts[i] > 1:
                rows = slice(starts[i], starts[i + 1])
                out[rows] = self._prefill(q[rows], k[rows], v[rows], kv_cache,
                                          metadata.block_tables[i:i + 1], seq_lens[i])
        return out.view(num_tokens, -1)

    def _decode(self, q, kv_cache, metadata, out, rows, requests, seq_lens) -> None:
        """One batched call for every single-query request."""
        index = torch.tensor(requests, device=q.device)
        rows_t = torch.tensor(rows, device=q.device)
        keys, values = gather_context(kv_cache, metadata.block_tables[index], max(seq_lens))
        lens = torch.tensor(seq_lens, device=q.device)
        mask = torch.arange(keys.shape[2], device=q.device) < lens.unsqueeze(-1)  # (B, L)
        queries = q[rows_t].unsqueeze(2)  # (B, H, 1, D)
        result = self._sdpa(queries, keys, values, mask[:, None, None, :])  # (B, H, 1, D)
        out[rows_t] = result.squeeze(2)

    def _prefill(self, q, k, v, kv_cache, block_table, seq_len) -> torch.Tensor:
        """q (n, H, D) of one request whose context is seq_len tokens -> (n, H, D)."""
        num_new = q.shape[0]
        if num_new == seq_len or kv_cache is None:
            out = self._sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=True)
            return out.transpose(0, 1)
        keys, values = gather_context(kv_cache, block_table, seq_len)
        keys, values = keys[0, :, :seq_len], values[0, :, :seq_len]  # (Hkv, L, D)
        query_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device) <= query_pos.unsqueeze(-1)  # (n, L)
        out = self._sdpa(q.transpose(0, 1), keys, values, mask)  # (H, n, D)
        return out.transpose(0, 1)
