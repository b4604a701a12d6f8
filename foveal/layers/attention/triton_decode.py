"""Triton kernels for paged KV on CUDA: the KV write and split-K decode attention.

Both read everything that varies from step to step (slots, block tables,
context lengths) from device tensors and take only shapes as Python values,
so a decode step built on them has static shapes and no host synchronisation:
it can be captured in a CUDA graph (foveal/worker/cuda_graphs.py).

Cache layout (kv_spec.py): (2, num_blocks, block_size, Hkv, D), 0 keys, 1 values.

Decode attention (flash-decoding): the grid is (requests, KV heads, splits);
each program takes the G query heads of one KV head (padded to 16 rows for
tl.dot) over its share of the request's pages, with an online softmax, and
writes a partial (max, sum, accumulator); a second kernel merges the splits.
Splits past a request's context write an empty partial. Sliding-window layers
skip the pages before the window and mask the keys before it.

On a machine without CUDA (or with TRITON_INTERPRET=1) the kernels run under
Triton's interpreter, on CPU tensors: the unit tests.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Triton can only interpret here (CPU tensors: the unit tests); it reads this
    # when it is first imported and when each kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

_MIN_ROWS = 16  # tl.dot needs at least 16 rows
_TARGET_PROGRAMS = 264  # about two programs per multiprocessor of a large GPU
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, row_stride, kv_offset,
                     WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """One token's K and V rows (Hkv * D each) to its slot; slot < 0: padding, skipped."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        cols = tl.arange(0, BLOCK)
        mask = cols < WIDTH
        k = tl.load(k_ptr + token * row_stride + cols, mask=mask)
        v = tl.load(v_ptr + token * row_stride + cols, mask=mask)
        out = cache_ptr + slot * WIDTH + cols
        tl.store(out, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(out + kv_offset, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v (T, Hkv*D) -> the flat slots (T,) of one layer's cache; negative slots skipped."""
    num_tokens, width = k.shape[0], kv_cache.shape[-2] * kv_cache.shape[-1]
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride(0) != v.stride(0):
        k, v = k.contiguous(), v.contiguous()
    _write_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping, k.stride(0), kv_cache[0].numel(),
        WIDTH=width, BLOCK=triton.next_power_of_2(width))


@triton.jit
def _attend_page(q, cache_ptr, tables_ptr, request, table_stride, page, seq_len, first_key,
                 kv_head, kv_offset, scale, m, s, acc, NUM_KV_HEADS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One page of keys into the online softmax state (m, s, acc) of the query rows q."""
    offsets = tl.arange(0, PAGE)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    block = tl.load(tables_ptr + request * table_stride + page).to(tl.int64)
    key_pos = page * PAGE + offsets  # (PAGE,)
    key_ok = (key_pos < seq_len) & (key_pos >= first_key)
    slot = block * PAGE + offsets
    addr = (slot[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]  # (PAGE, D)
    k = tl.load(cache_ptr + addr, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    v = tl.load(cache_ptr + kv_offset + addr, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    scores = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
    scores = tl.where(key_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    s = s * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return m_new, s, acc


@triton.jit
def _decode_kernel(q_ptr, cache_ptr, tables_ptr, lens_ptr, part_out_ptr, part_ml_ptr,
                   scale, window, q_stride, table_stride, kv_offset, pages_per_split, num_splits,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                   PRECISION: tl.constexpr, PORTABLE_LOOP: tl.constexpr):
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + request)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    head = kv_head * GROUP + rows  # (ROWS,) query heads of this KV head
    q = tl.load(q_ptr + request * q_stride + head[:, None] * HEAD_DIM + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (ROWS, BLOCK_D)
    first_key = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    page_lo = tl.maximum(split * pages_per_split, first_key // PAGE)
    page_hi = tl.minimum((split + 1) * pages_per_split, (seq_len + PAGE - 1) // PAGE)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    s = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
    if PORTABLE_LOOP:  # the CPU interpreter cannot index a range by loaded scalars
        page = page_lo
        while page < page_hi:
            m, s, acc = _attend_page(q, cache_ptr, tables_ptr, request, table_stride, page,
                                     seq_len, first_key, kv_head, kv_offset, scale, m, s, acc,
                                     NUM_KV_HEADS, HEAD_DIM, BLOCK_D, PAGE, PRECISION)
            page += 1
    else:
        for page in range(page_lo, page_hi):
            m, s, acc = _attend_page(q, cache_ptr, tables_ptr, request, table_stride, page,
                                     seq_len, first_key, kv_head, kv_offset, scale, m, s, acc,
                                     NUM_KV_HEADS, HEAD_DIM, BLOCK_D, PAGE, PRECISION)
    part = (request * NUM_KV_HEADS * GROUP + head) * num_splits + split  # (ROWS,)
    tl.store(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], acc,
             mask=row_ok[:, None])
    tl.store(part_ml_ptr + part * 2, m, mask=row_ok)
    tl.store(part_ml_ptr + part * 2 + 1, s, mask=row_ok)


@triton.jit
def _merge_kernel(part_out_ptr, part_ml_ptr, out_ptr, out_stride, num_splits,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  SPLITS_POW2: tl.constexpr):
    request = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_POW2)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    part = (request * NUM_HEADS + head) * num_splits + splits
    m = tl.load(part_ml_ptr + part * 2, mask=split_ok, other=float("-inf"))
    s = tl.load(part_ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    m_all = tl.max(m, axis=0)
    weight = tl.where(s > 0, tl.exp(tl.where(s > 0, m - m_all, 0.0)), 0.0)  # empty: nothing
    acc = tl.load(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :],
                  mask=split_ok[:, None], other=0.0)
    total = tl.sum(weight * s, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + request * out_stride + head * HEAD_DIM + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def num_splits(batch: int, num_kv_heads: int, max_pages: int) -> int:
    """Splits per (request, KV head): enough programs to fill a large GPU, at
    least 4 pages each."""
    wanted = triton.cdiv(_TARGET_PROGRAMS, max(1, batch * num_kv_heads))
    return max(1, min(wanted, triton.cdiv(max_pages, 4), 64))


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                 splits: int | None = None) -> torch.Tensor:
    """One query per request over its paged context.

    q (B, H*D); kv_cache (2, num_blocks, block_size, Hkv, D); block_tables
    (B, max_pages) int32; seq_lens (B,) int32 context lengths including the
    query's own token (0: an idle padding row, its output is zeros).
    splits: a fixed split count (CUDA graphs); None picks one from the shapes.
    -> (B, H*D) in q's dtype.
    """
    batch = q.shape[0]
    _, _, page, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1] // head_dim
    group = num_heads // num_kv_heads
    splits = splits or num_splits(batch, num_kv_heads, block_tables.shape[1])
    pages_per_split = triton.cdiv(block_tables.shape[1], splits)
    block_d = triton.next_power_of_2(head_dim)
    part_out = torch.empty(batch * num_heads * splits, block_d, device=q.device,
                           dtype=torch.float32)
    part_ml = torch.empty(batch * num_heads * splits, 2, device=q.device, dtype=torch.float32)
    out = torch.empty(batch, num_heads * head_dim, device=q.device, dtype=q.dtype)
    if batch == 0:
        return out
    q = q.contiguous()
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, kv_cache, block_tables, seq_lens, part_out, part_ml,
        scale, sliding_window or 0, q.stride(0), block_tables.stride(0), kv_cache[0].numel(),
        pages_per_split, splits,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, ROWS=max(_MIN_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page,
        PRECISION="ieee" if kv_cache.dtype == torch.float32 else None,  # no TF32 for fp32
        PORTABLE_LOOP=_INTERPRETED)
    _merge_kernel[(batch, num_heads)](
        part_out, part_ml, out, out.stride(0), splits,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        SPLITS_POW2=triton.next_power_of_2(splits))
    return out
