"""Paged SDPA attention equals dense causal attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foveal.errors import ConfigError
from foveal.forward_context import AttentionMetadata, forward_context
from foveal.layers.attention import Attention, get_attention_backend, register_attention_backend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 64


def dense_causal(q, k, v, window: int | None = None) -> torch.Tensor:
    """q (L, H, D), k/v (L, Hkv, D) full sequence -> (L, H, D); window: each query
    sees itself and the window - 1 keys before it."""
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    pos = torch.arange(q.shape[0])
    mask = pos[None, :] <= pos[:, None]
    if window:
        mask &= pos[None, :] > pos[:, None] - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=HEAD_DIM ** -0.5)
    return out.transpose(0, 1)


def batch_metadata(requests: list[tuple[int, int]], tables: list[list[int]],
                   slots: list[torch.Tensor]) -> AttentionMetadata:
    """Layout of one step: (computed, new) per request, its block table, its new tokens' slots."""
    width = max(len(t) for t in tables)
    starts = [0]
    for _, new in requests:
        starts.append(starts[-1] + new)
    seq_lens = [c + n for c, n in requests]
    return AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(n for _, n in requests), max_seq_len=max(seq_lens), block_size=BLOCK_SIZE,
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)


def run_mixed_batch(requests: list[tuple[int, int]], seed: int, window: int | None = None):
    """requests: (already computed, new) per request. The cached prefix is
    written by an earlier step; this step runs every request's new tokens.
    window: a sliding-window layer; the cached keys before its window hold NaN
    (blocks given back and reused), which it must never read."""
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    layer = Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, layer_idx=0,
                      sliding_window=window)
    full, tables, q_new, k_new, v_new, slots = [], [], [], [], [], []
    for computed, new in requests:
        length = computed + new
        q, k, v = randn(length, NUM_HEADS, HEAD_DIM), randn(length, NUM_KV_HEADS, HEAD_DIM), randn(
            length, NUM_KV_HEADS, HEAD_DIM)
        table = [free_blocks.pop() for _ in range(-(-length // BLOCK_SIZE))]
        flat = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)])
        kv_cache[0].view(-1, NUM_KV_HEADS, HEAD_DIM)[flat[:computed]] = k[:computed]
        kv_cache[1].view(-1, NUM_KV_HEADS, HEAD_DIM)[flat[:computed]] = v[:computed]
        if window and computed:
            unread = flat[:max(0, computed - window + 1)]
            kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)[:, unread] = float("nan")
        full.append(dense_causal(q, k, v, window)[computed:])
        tables.append(table)
        q_new.append(q[computed:]), k_new.append(k[computed:]), v_new.append(v[computed:])
        slots.append(flat[computed:])
    metadata = batch_metadata(requests, tables, slots)
    with forward_context(metadata, [kv_cache]):
        out = layer(torch.cat(q_new).flatten(1), torch.cat(k_new).flatten(1), torch.cat(v_new).flatten(1))
    return out.view(-1, NUM_HEADS, HEAD_DIM), torch.cat(full), kv_cache, torch.cat(slots), torch.cat(k_new)


@pytest.mark.parametrize("seed", range(3))
def test_paged_attention_equals_dense_for_mixed_batch(seed):
    requests = [(0, 9), (13, 1), (5, 6), (0, 1), (22, 1), (7, 3), (30, 1)]
    out, expected, *_ = run_mixed_batch(requests, seed)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(2))
def test_sliding_window_layer_reads_only_its_window(seed):
    requests = [(0, 9), (13, 1), (5, 6), (22, 1), (17, 5), (30, 1), (3, 1)]
    out, expected, *_ = run_mixed_batch(requests, seed, window=6)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_only_batch_equals_dense():
    out, expected, *_ = run_mixed_batch([(3, 1), (17, 1), (8, 1), (0, 1)], seed=7)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_new_keys_are_written_at_their_slots():
    _, _, kv_cache, slots, k_new = run_mixed_batch([(4, 5), (9, 1)], seed=1)
    assert torch.equal(kv_cache[0].view(-1, NUM_KV_HEADS, HEAD_DIM)[slots], k_new)


def test_attention_without_metadata_is_causal_over_the_batch():
    q, k, v = torch.randn(6, NUM_HEADS, HEAD_DIM), torch.randn(6, NUM_KV_HEADS, HEAD_DIM), torch.randn(
        6, NUM_KV_HEADS, HEAD_DIM)
    layer = Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, layer_idx=0)
    with forward_context(None, []):
        out = layer(q.flatten(1), k.flatten(1), v.flatten(1))
    torch.testing.assert_close(out.view(6, NUM_HEADS, HEAD_DIM), dense_causal(q, k, v))


def test_backend_registry_picks_registered_default_for_device(monkeypatch):
    import foveal.layers.attention as attention
    from foveal.layers.attention import sdpa

    monkeypatch.setattr(attention, "_BACKENDS", dict(attention._BACKENDS))
    monkeypatch.setattr(attention, "_DEVICE_DEFAULTS", dict(attention._DEVICE_DEFAULTS))

    register_attention_backend("sdpa-copy", "foveal.layers.attention.sdpa:SdpaBackend", default_for=("xpu",))
    assert get_attention_backend("xpu") is sdpa.SdpaBackend
    assert get_attention_backend("cpu") is sdpa.SdpaBackend
    with pytest.raises(ConfigError, match="sdpa"):
        get_attention_backend("cpu", "flash-nonexistent")
