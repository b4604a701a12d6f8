"""Attention over a quantized paged KV cache, read chunk by chunk.

A request's keys and values are never materialized in full precision: each
chunk of context slots is gathered in its stored form (int8 / packed int4 /
fp8 plus one scale per token and head), dequantized, and folded into the
output with an online softmax (running max m, normalizer l, accumulator acc).
Peak memory is one chunk of K/V, whatever the context length. Scales are not
applied to K and V (chunk x head_dim values) but folded into the scores and
the softmax weights (chunk values per query row), which are far smaller.

Every query row, in decode and in prefill alike, reads its keys from the
cache, so a token's K/V is the same quantized value whether it was computed in
this step, an earlier chunk, or came from a prefix-cache hit.
"""
from __future__ import annotations

import torch

from foveal.layers.attention.kv_quant import KVCodec
from foveal.layers.attention.kv_spec import slot_view

CHUNK_TOKENS = 2048


def write_quantized_kv(kv_cache: torch.Tensor, kv_scales: torch.Tensor, codec: KVCodec,
                       k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                       static_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Quantize k/v (T, Hkv, D) into their slots (T,) of one layer's cache and scales."""
    slots, scale_slots = slot_view(kv_cache), slot_view(kv_scales)  # (2, S, Hkv, Dq), (2, S, Hkv)
    for index, x in enumerate((k, v)):
        static = None if static_scales is None else static_scales[index]
        stored, scale = codec.quantize(x, static)
        slots[index][slot_mapping] = stored
        scale_slots[index][slot_mapping] = scale


def attend_quantized(queries: torch.Tensor, query_positions: torch.Tensor,
                     seq_lens: torch.Tensor, context_slots: torch.Tensor,
                     kv_cache: torch.Tensor, kv_scales: torch.Tensor, codec: KVCodec,
                     scale: float, chunk_tokens: int = CHUNK_TOKENS, *,
                     key_starts: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of queries over their requests' cached context.

    queries:         (B, Hkv, Q, D) rows grouped by KV head (GQA rides in Q)
    query_positions: (B, Q) context position of each row (keys at <= it count;
                     a bidirectional span's queries pass the span's last position)
    key_starts:      (B, Q) first key position each row sees (sliding windows); None: 0
    seq_lens:        (B,) context length of each request
    context_slots:   (B, L) flat cache slot of context positions 0..L-1 (padding
                     beyond seq_len may point anywhere: it is masked)
    Returns (B, Hkv, Q, D) in the queries' dtype.
    """
    batch, num_kv_heads, num_rows, _ = queries.shape
    dtype = queries.dtype
    # (2, slots * Hkv, Dq) and (2, slots * Hkv): row slot * Hkv + h is head h of a slot,
    # so one gather gives a chunk already laid out (B, Hkv, C, ...) for the matmuls.
    rows = slot_view(kv_cache).flatten(1, 2)
    row_scales = slot_view(kv_scales).flatten(1, 2)
    heads = torch.arange(num_kv_heads, device=queries.device).view(1, -1, 1)  # (1, Hkv, 1)
    running_max = queries.new_full((batch, num_kv_heads, num_rows, 1), float("-inf"))
    normalizer = queries.new_zeros((batch, num_kv_heads, num_rows, 1))
    acc = torch.zeros_like(queries)
    limits = torch.minimum(query_positions, (seq_lens - 1).unsqueeze(-1))  # (B, Q)
    for start in range(0, context_slots.shape[1], chunk_tokens):
        chunk = context_slots[:, start:start + chunk_tokens]  # (B, C)
        index = chunk.unsqueeze(1) * num_kv_heads + heads  # (B, Hkv, C)
        keys = codec.decode_raw(_gather_rows(rows[0], index), dtype)  # (B, Hkv, C, D), unscaled
        values = codec.decode_raw(_gather_rows(rows[1], index), dtype)
        # scales (B, Hkv, 1, C), with raw_factor and the softmax scale folded in
        key_scale = _gather_rows(row_scales[0], index).to(dtype).unsqueeze(2) \
            * (codec.raw_factor * scale)
        value_scale = _gather_rows(row_scales[1], index).to(dtype).unsqueeze(2) * codec.raw_factor
        scores = torch.matmul(queries, keys.transpose(-1, -2)) * key_scale  # (B, Hkv, Q, C)
        key_positions = torch.arange(start, start + chunk.shape[1], device=queries.device)
        visible = key_positions <= limits.unsqueeze(-1)  # (B, Q, C)
        if key_starts is not None:
            visible = visible & (key_positions >= key_starts.unsqueeze(-1))
        scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        weights = torch.exp(scores - safe_max)  # (B, Hkv, Q, C)
        correction = torch.exp(running_max - safe_max)
        normalizer = normalizer * correction + weights.sum(dim=-1, keepdim=True)
        acc = acc * correction + torch.matmul(weights * value_scale, values)
        running_max = new_max
    return acc / normalizer


def _gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for a (rows, ...) table: index_select copies whole contiguous
    rows, several times faster on CPU than advanced indexing of small rows."""
    rows = table.index_select(0, index.reshape(-1))
    return rows.view(*index.shape, *table.shape[1:])
