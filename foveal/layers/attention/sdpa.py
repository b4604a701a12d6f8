"""CPU reference attention backend on torch scaled_dot_product_attention.

What depends only on the batch layout (which rows decode, the flat cache
slots of every context position, the padding masks) is derived once per
forward (`StepLayout`) and shared by all layers, so a decode step costs each
layer one gather of K and V and one SDPA call. GQA runs without expanding K/V:
the G query heads that share a KV head ride as G query rows of that head.

Sliding-window layers and bidirectional spans (AttentionMetadata) give each
query an interval of visible key positions [first, last] (`key_bounds`):
causal, its last widened to the end of the span it sits in, its first
narrowed to the window. Such layers take the masked paths below; a sliding
layer gathers only the keys of its window, so its cost stays that of the
window however long the context grows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from foveal.forward_context import AttentionMetadata
from foveal.kernels.native import native_kernels
from foveal.layers.attention.blockwise import attend_quantized, write_quantized_kv
from foveal.layers.attention.kv_quant import codec_for_storage
from foveal.layers.attention.kv_spec import slot_view


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k/v (T, Hkv, D) at flat slots (T,) of one layer's cache."""
    slots = slot_view(kv_cache)  # (2, num_slots, Hkv, D)
    slots[0][slot_mapping] = k.to(kv_cache.dtype)
    slots[1][slot_mapping] = v.to(kv_cache.dtype)


def context_slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """block_tables (B, nb) -> flat cache slots (B, length) of positions 0..length-1."""
    positions = torch.arange(length, device=block_tables.device)
    blocks = block_tables[:, positions // block_size].long()  # (B, length)
    return blocks * block_size + positions % block_size


def _sdpa_3d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """SDPA on (heads, rows, D) tensors, called with a batch dimension: given 3-D inputs,
    torch's CPU dispatch runs the unfused math kernel, 6-14x slower than the flash
    kernel it picks for the same 4-D call (one LLaVA-NeXT prompt of 1,208 tokens in
    bf16: 930 ms vs 90 ms per layer; docs/benchmarks.md)."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], **kwargs)[0]


@dataclass
class _Prefill:
    rows: slice  # query rows of this request in the flattened batch
    seq_len: int  # context length after this step
    slots: torch.Tensor | None  # (seq_len,) cache slots; None when all context is new
    request: int = 0  # index in the batch


@dataclass
class StepLayout:
    decode_rows: torch.Tensor | None  # (Bd,) rows of single-query requests
    decode_slots: torch.Tensor | None  # (Bd, Lmax) flat slots, padding points at slot 0
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, Lmax) True where the key is real;
    # None when every decode row sees all Lmax keys (one request, or equal lengths)
    decode_lens: torch.Tensor | None  # (Bd,) context lengths
    prefills: list[_Prefill]
    decode_requests: torch.Tensor | None = None  # (Bd,) batch indices of the decode rows
    all_decode: bool = False  # every row is its request's one query (rows = requests, in order)

    @classmethod
    def build(cls, metadata: AttentionMetadata, context_always: bool = False,
              decode_slots: bool = True) -> "StepLayout":
        """context_always: give every prefill its context slots, even when all
        of its context is new (quantized caches read every key from the cache);
        decode_slots: False for kernels that read the block tables themselves."""
        starts = metadata.query_start_loc_cpu or metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens_cpu or metadata.seq_lens.tolist()
        decodes = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
        prefills = [cls._prefill(metadata, starts, seq_lens, i, context_always)
                    for i in range(len(seq_lens)) if starts[i + 1] - starts[i] > 1]
        if not decodes:
            return cls(None, None, None, None, prefills)
        device = metadata.block_tables.device
        lens = torch.tensor([seq_lens[i] for i in decodes], device=device)
        requests = torch.tensor(decodes, device=device)
        rows = torch.tensor([starts[i] for i in decodes], device=device)
        if not decode_slots:
            return cls(rows, None, None, lens, prefills, requests)
        max_len = int(max(seq_lens[i] for i in decodes))
        tables = metadata.block_tables[requests]
        slots = context_slots(tables, max_len, metadata.block_size)  # (Bd, Lmax)
        mask = None
        if any(seq_lens[i] != max_len for i in decodes):
            mask = (torch.arange(max_len, device=device) < lens.unsqueeze(-1))[:, None, None, :]
        return cls(rows, slots, mask, lens, prefills, requests, all_decode=not prefills)

    @staticmethod
    def _prefill(metadata, starts, seq_lens, i, context_always: bool) -> _Prefill:
        num_new, seq_len = starts[i + 1] - starts[i], seq_lens[i]
        slots = None
        if num_new < seq_len or context_always:
            slots = context_slots(metadata.block_tables[i:i + 1], seq_len,
                                  metadata.block_size)[0]
        return _Prefill(slice(starts[i], starts[i + 1]), seq_len, slots, i)


def key_bounds(spans, prefill: _Prefill, window: int | None,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, last) visible key position of each new query of one request, (n,) each.

    spans: the request's bidirectional [start, end) ranges (AttentionMetadata)."""
    num_new = prefill.rows.stop - prefill.rows.start
    positions = torch.arange(prefill.seq_len - num_new, prefill.seq_len, device=device)  # (n,)
    last = positions.clone()
    for start, end in spans:
        inside = (positions >= start) & (positions < end)
        last = torch.where(inside, min(end, prefill.seq_len) - 1, last)
    first = positions - window + 1 if window else torch.zeros_like(positions)
    return first, last


def _spans(metadata: AttentionMetadata | None, request: int) -> list[tuple[int, int]]:
    if metadata is None or metadata.bidirectional_spans is None:
        return []
    return metadata.bidirectional_spans[request]


class SdpaBackend:
    layout_key = "sdpa"  # where the step's StepLayout is kept in backend_cache

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale
        self.group = num_heads // num_kv_heads
        self.sliding_window = sliding_window
        # Pure decode steps on a float cache run the native decode attention (the KV
        # write, the paged gather and the softmax in one call instead of some twenty
        # ops; docs/benchmarks.md "Native decode kernels"), where it is built. Read
        # once, when the layer first runs.
        self.native = native_kernels()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, metadata: AttentionMetadata | None,
                kv_scales: torch.Tensor | None = None,
                static_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q (T, H*D), k/v (T, Hkv*D) -> (T, H*D).

        kv_scales: the layer's scales when the cache holds quantized blocks;
        static_scales: per-head (k, v) scales from the checkpoint (fp8), if any.
        """
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if metadata is None:
            if self.sliding_window:
                return self._bounded(q, k, v, _Prefill(slice(0, num_tokens), num_tokens, None),
                                     None, metadata).reshape(num_tokens, -1)
            return self._causal(q, k, v).reshape(num_tokens, -1)
        if kv_scales is not None:
            return self._quantized(q, k, v, kv_cache, kv_scales, metadata,
                                   static_scales).view(num_tokens, -1)
        if metadata.max_query_len == 1 and self._native_decode_applies(q, k, kv_cache):
            return self.native.decode_attention(
                q, k, v, slot_view(kv_cache), metadata.slot_mapping, metadata.block_tables,
                metadata.block_size, metadata.seq_lens, self.scale,
                self.sliding_window).view(num_tokens, -1)
        if kv_cache is not None and kv_cache.numel() > 0:
            self._write(kv_cache, k, v, metadata.slot_mapping)
        layout = metadata.backend_cache.get(self.layout_key)
        if layout is None:
            layout = metadata.backend_cache[self.layout_key] = StepLayout.build(
                metadata, decode_slots=self.layout_key == "sdpa")
        if layout.all_decode:  # a decode step: no row to scatter
            return self._decode(q, kv_cache, layout, metadata).view(num_tokens, -1)
        out = torch.empty_like(q)  # (T, H, D)
        if layout.decode_rows is not None:
            out[layout.decode_rows] = self._decode(q[layout.decode_rows], kv_cache, layout,
                                                   metadata)
        bounded = self.sliding_window is not None or metadata.bidirectional_spans is not None
        for prefill in layout.prefills:
            rows = prefill.rows
            if bounded:
                out[rows] = self._bounded(q[rows], k[rows], v[rows], prefill, kv_cache, metadata)
            elif prefill.slots is None:
                out[rows] = self._causal(q[rows], k[rows], v[rows])
            else:
                out[rows] = self._with_context(q[rows], kv_cache, prefill)
        return out.view(num_tokens, -1)

    def _native_decode_applies(self, q: torch.Tensor, k: torch.Tensor,
                               kv_cache: torch.Tensor | None) -> bool:
        """On a contiguous float32 or bfloat16 CPU cache that holds the model's dtype."""
        return (self.native is not None and kv_cache is not None and kv_cache.numel() > 0
                and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
                and q.dtype == k.dtype == kv_cache.dtype and kv_cache.is_contiguous())

    def _quantized(self, q, k, v, kv_cache, kv_scales, metadata, static_scales) -> torch.Tensor:
        """Every row reads its keys from the quantized cache, chunk by chunk."""
        codec = codec_for_storage(kv_cache.dtype)
        write_quantized_kv(kv_cache, kv_scales, codec, k, v, metadata.slot_mapping, static_scales)
        layout = metadata.backend_cache.get("sdpa_quantized")
        if layout is None:
            layout = metadata.backend_cache["sdpa_quantized"] = StepLayout.build(
                metadata, context_always=True)
        out = torch.empty_like(q)  # (T, H, D)
        attend = lambda queries, positions, lens, slots, firsts=None: attend_quantized(  # noqa: E731
            queries, positions, lens, slots, kv_cache, kv_scales, codec, self.scale, key_starts=firsts)
        window = self.sliding_window
        if layout.decode_rows is not None:
            batch = layout.decode_rows.shape[0]
            queries = q[layout.decode_rows].view(batch, self.num_kv_heads, self.group, -1)
            positions = (layout.decode_lens - 1).unsqueeze(-1).expand(batch, self.group)
            firsts = positions - window + 1 if window else None
            out[layout.decode_rows] = attend(queries, positions, layout.decode_lens,
                                             layout.decode_slots, firsts).reshape(batch, self.num_heads, -1)
        for prefill in layout.prefills:
            rows, seq_len = prefill.rows, prefill.seq_len
            num_new = rows.stop - rows.start
            first, last = key_bounds(_spans(metadata, prefill.request), prefill, window, q.device)
            positions = last.repeat_interleave(self.group)[None]  # (1, n*G), as _grouped
            firsts = first.repeat_interleave(self.group)[None] if window else None
            lens = torch.tensor([seq_len], device=q.device)
            grouped = attend(self._grouped(q[rows])[None], positions, lens, prefill.slots[None],
                             firsts)
            out[rows] = self._ungrouped(grouped[0], num_new)
        return out

    def _write(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
        write_kv(kv_cache, k, v, slot_mapping)

    def _grouped(self, q: torch.Tensor) -> torch.Tensor:
        """(n, H, D) -> (Hkv, n*G, D): query heads sharing a KV head side by side."""
        n = q.shape[0]
        q = q.view(n, self.num_kv_heads, self.group, self.head_dim)
        return q.permute(1, 0, 2, 3).reshape(self.num_kv_heads, n * self.group, self.head_dim)

    def _ungrouped(self, out: torch.Tensor, n: int) -> torch.Tensor:
        """(Hkv, n*G, D) -> (n, H, D)."""
        out = out.view(self.num_kv_heads, n, self.group, self.head_dim)
        return out.permute(1, 0, 2, 3).reshape(n, self.num_heads, self.head_dim)

    def _causal(self, q, k, v) -> torch.Tensor:
        """One fresh sequence: q (n, H, D), k/v (n, Hkv, D) -> (n, H, D)."""
        out = _sdpa_3d(
            q.transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
            is_causal=True, scale=self.scale, enable_gqa=self.group > 1)  # (H, n, D)
        return out.transpose(0, 1)

    def _decode_keys(self, metadata: AttentionMetadata, layout: StepLayout
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots (Bd, L), mask (Bd, 1, 1, L)) of the keys decode rows see: the whole
        context, or on sliding-window layers the last window only, L = min(window,
        Lmax) (a one-token step is never inside a span but its last token)."""
        if not self.sliding_window:
            return layout.decode_slots, layout.decode_mask
        key = ("sdpa_decode_window", self.sliding_window)
        if key not in metadata.backend_cache:
            width = min(self.sliding_window, layout.decode_slots.shape[1])
            offsets = torch.arange(width, device=layout.decode_lens.device)
            positions = layout.decode_lens.unsqueeze(-1) - width + offsets  # (Bd, L)
            slots = layout.decode_slots.gather(1, positions.clamp(min=0))
            metadata.backend_cache[key] = (slots, (positions >= 0)[:, None, None, :])
        return metadata.backend_cache[key]

    def _bounded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefill: _Prefill,
                 kv_cache: torch.Tensor | None, metadata: AttentionMetadata | None) -> torch.Tensor:
        """A prefill chunk whose queries see [first, last] key intervals (key_bounds):
        q (n, H, D), k/v (n, Hkv, D) of the chunk -> (n, H, D)."""
        num_new, seq_len = q.shape[0], prefill.seq_len
        low = 0  # the first key position any query sees (spans only widen the last)
        if prefill.slots is None:  # all context is this chunk
            keys, values = k.transpose(0, 1), v.transpose(0, 1)  # (Hkv, n, D)
        else:
            if self.sliding_window:
                low = max(0, seq_len - num_new - self.sliding_window + 1)
            slots = slot_view(kv_cache)  # (2, num_slots, Hkv, D)
            keys = slots[0].index_select(0, prefill.slots[low:]).transpose(0, 1)  # (Hkv, L, D)
            values = slots[1].index_select(0, prefill.slots[low:]).transpose(0, 1)
        key = ("sdpa_bounds", self.sliding_window, prefill.request)
        cache = metadata.backend_cache if metadata is not None else {}
        if key not in cache:
            first, last = key_bounds(_spans(metadata, prefill.request), prefill,
                                     self.sliding_window, q.device)
            key_pos = torch.arange(low, seq_len, device=q.device)
            mask = (key_pos >= first.unsqueeze(-1)) & (key_pos <= last.unsqueeze(-1))  # (n, L)
            cache[key] = mask.repeat_interleave(self.group, dim=0)  # (n*G, L), as _grouped
        out = _sdpa_3d(
            self._grouped(q), keys.to(q.dtype), values.to(q.dtype), attn_mask=cache[key],
            scale=self.scale)  # (Hkv, n*G, D)
        return self._ungrouped(out, num_new)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, layout: StepLayout,
                metadata: AttentionMetadata) -> torch.Tensor:
        """q (Bd, H, D), one query per request -> (Bd, H, D)."""
        context_slots, mask = self._decode_keys(metadata, layout)
        batch, max_len = context_slots.shape
        flat = context_slots.reshape(-1)
        slots = slot_view(kv_cache)  # (2, num_slots, Hkv, D)
        # index_select copies whole slot rows: faster on CPU than advanced indexing
        keys = slots[0].index_select(0, flat).view(batch, max_len, self.num_kv_heads, -1)
        values = slots[1].index_select(0, flat).view(batch, max_len, self.num_kv_heads, -1)
        queries = q.view(batch, self.num_kv_heads, self.group, self.head_dim)  # (Bd, Hkv, G, D)
        out = F.scaled_dot_product_attention(
            queries, keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
            attn_mask=mask, scale=self.scale)  # (Bd, Hkv, G, D)
        return out.reshape(batch, self.num_heads, self.head_dim)

    def _with_context(self, q: torch.Tensor, kv_cache: torch.Tensor, prefill: _Prefill
                      ) -> torch.Tensor:
        """A chunk after cached context: q (n, H, D) at positions seq_len-n.. -> (n, H, D)."""
        num_new, seq_len = q.shape[0], prefill.seq_len
        slots = slot_view(kv_cache)  # (2, num_slots, Hkv, D)
        keys = slots[0].index_select(0, prefill.slots).transpose(0, 1)  # (Hkv, L, D)
        values = slots[1].index_select(0, prefill.slots).transpose(0, 1)
        query_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device) <= query_pos.unsqueeze(-1)  # (n, L)
        mask = mask.repeat_interleave(self.group, dim=0)  # (n*G, L), rows as _grouped lays out
        out = _sdpa_3d(
            self._grouped(q), keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
            scale=self.scale)  # (Hkv, n*G, D)
        return self._ungrouped(out, num_new)
