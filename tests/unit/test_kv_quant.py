"""Quantized KV: codec round trips, the packed int4 layout, and paged attention
over quantized blocks equal to dense attention over the dequantized K/V."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from foveal.errors import ConfigError
from foveal.forward_context import forward_context
from foveal.layers.attention import Attention
from foveal.layers.attention.kv_quant import get_kv_codec
from foveal.layers.attention.kv_spec import KVCacheSpec, slot_view
from tests.unit.test_attention import (BLOCK_SIZE, HEAD_DIM, NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS,
                                       batch_metadata, dense_causal)

# Worst-case error of one value, as a fraction of its vector's max magnitude:
# half a quantization step (int8, int4), or fp8 e4m3's relative rounding (2^-4).
BOUNDS = {"int8": 0.5 / 127, "int4": 0.5 / 7, "fp8_e4m3": 2 ** -4}


@pytest.mark.parametrize("name", sorted(BOUNDS))
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), magnitude=st.floats(1e-3, 1e3))
def test_round_trip_error_is_within_the_codec_bound(name, seed, magnitude):
    codec = get_kv_codec(name)
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(seed)) * magnitude
    stored, scale = codec.quantize(x)
    assert stored.dtype == codec.storage_dtype and stored.shape[-1] == codec.stored_dim(16)
    assert scale.shape == (5, 3) and scale.dtype == torch.float16
    error = (codec.dequantize(stored, scale) - x).abs()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # float16 scale rounding adds at most 2^-11 relative on top
    assert torch.all(error <= amax * (BOUNDS[name] + 2 ** -10) + 1e-6)


def test_int4_packs_two_values_per_byte_low_nibble_first():
    codec = get_kv_codec("int4")
    x = torch.tensor([[7.0, -7.0, 1.0, -1.0, 0.0, 3.0]])
    stored, scale = codec.quantize(x)
    assert scale.item() == 1.0
    # (7, -7) -> 0x7 | 0x9 << 4; (1, -1) -> 0x1 | 0xF << 4; (0, 3) -> 0x0 | 0x3 << 4
    assert stored.tolist() == [[0x97, 0xF1, 0x30]]
    assert codec.dequantize(stored, scale).tolist() == x.tolist()


def test_all_zero_vectors_round_trip_to_zero():
    for name in BOUNDS:
        codec = get_kv_codec(name)
        stored, scale = codec.quantize(torch.zeros(2, 4, 8))
        assert torch.equal(codec.dequantize(stored, scale), torch.zeros(2, 4, 8))


def test_static_scales_are_used_as_given():
    codec = get_kv_codec("fp8_e4m3")
    x = torch.randn(3, 2, 8)
    stored, scale = codec.quantize(x, torch.tensor([0.5, 0.25]))
    assert scale.tolist() == [[0.5, 0.25]] * 3
    torch.testing.assert_close(codec.dequantize(stored, scale), x, atol=0.1, rtol=2 ** -3)


def test_unknown_quantized_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="int8"):
        get_kv_codec("int3")


def quantized_batch(name: str, requests: list[tuple[int, int]], seed: int):
    """Like test_attention.run_mixed_batch, on a quantized pool: the cached
    prefix is quantized into the pool by an earlier step."""
    codec = get_kv_codec(name)
    spec = KVCacheSpec(1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, quantization=name)
    pool = spec.allocate(NUM_BLOCKS, "cpu")
    cache, scales = pool.layers[0], pool.scales[0]
    generator = torch.Generator().manual_seed(seed)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    layer = Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, layer_idx=0)
    expected, tables, news, slots = [], [], [], []
    for computed, new in requests:
        length = computed + new
        q = torch.randn(length, NUM_HEADS, HEAD_DIM, generator=generator)
        k, v = (torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=generator) for _ in "kv")
        table = [free_blocks.pop() for _ in range(-(-length // BLOCK_SIZE))]
        flat = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                             for p in range(length)])
        for index, x in enumerate((k, v)):
            stored, scale = codec.quantize(x[:computed])
            slot_view(cache)[index][flat[:computed]] = stored
            slot_view(scales)[index][flat[:computed]] = scale
        k_read, v_read = (codec.dequantize(*codec.quantize(x)) for x in (k, v))
        expected.append(dense_causal(q, k_read, v_read)[computed:])
        tables.append(table)
        news.append((q[computed:], k[computed:], v[computed:]))
        slots.append(flat[computed:])
    metadata = batch_metadata(requests, tables, slots)
    q_new, k_new, v_new = (torch.cat(parts) for parts in zip(*news))
    with forward_context(metadata, [cache], [scales]):
        out = layer(q_new.flatten(1), k_new.flatten(1), v_new.flatten(1))
    return out.view(-1, NUM_HEADS, HEAD_DIM), torch.cat(expected)


@pytest.mark.parametrize("name", sorted(BOUNDS))
@pytest.mark.parametrize("seed", range(2))
def test_paged_attention_over_quantized_blocks_equals_dense_over_dequantized(name, seed):
    requests = [(0, 9), (13, 1), (5, 6), (0, 1), (22, 1), (7, 3), (30, 1)]
    out, expected = quantized_batch(name, requests, seed)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_long_context_is_read_in_chunks_with_the_same_result(monkeypatch):
    import foveal.layers.attention.blockwise as blockwise

    requests = [(100, 1), (40, 7), (3, 1)]
    whole, expected = quantized_batch("int8", requests, seed=3)
    monkeypatch.setattr(blockwise, "CHUNK_TOKENS", 8)
    monkeypatch.setattr(blockwise.attend_quantized, "__defaults__", (8,))
    chunked, _ = quantized_batch("int8", requests, seed=3)
    torch.testing.assert_close(chunked, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
