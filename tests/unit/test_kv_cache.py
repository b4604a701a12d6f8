import dataclasses

import pytest
import torch

from foveal.config import CacheConfig, ModelConfig, TextConfig, VisionConfig
from foveal.engine.kv_groups import KVCacheGroups
from foveal.errors import ConfigError
from foveal.worker.device import resolve_device, resolve_dtype, torch_dtype
from foveal.layers.attention.kv_spec import KVCacheSpec
from foveal.worker.kv_cache import available_kv_memory, kv_cache_spec


def kv_cache_bytes_per_block(config, block_size, dtype) -> int:
    return spec_for(config, block_size, dtype).block_bytes


def spec_for(config, block_size, dtype) -> KVCacheSpec:
    name = str(dtype).removeprefix("torch.")
    return kv_cache_spec(config, CacheConfig(block_size=block_size), name)


def num_blocks_for(memory_bytes, config, block_size, dtype, max_model_len) -> int:
    return spec_for(config, block_size, dtype).num_blocks_for(memory_bytes, max_model_len)


def _model_config(layers=3, kv_heads=2, head_dim=8) -> ModelConfig:
    text = TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
                      rope_theta=10000.0, mrope_section=(2, 1, 1),
                      max_position_embeddings=512, tie_word_embeddings=True)
    vision = VisionConfig(variant="qwen2_vl", depth=1, hidden_size=16, num_heads=2,
                          intermediate_size=32, out_hidden_size=32, patch_size=14,
                          temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                          hidden_act="quick_gelu")
    return ModelConfig(architecture="Qwen2VLForConditionalGeneration", model_type="qwen2_vl",
                       text=text, vision=vision, image_token_id=60, video_token_id=61,
                       vision_start_token_id=62, vision_end_token_id=63)


def test_bytes_per_block_counts_keys_values_layers_heads_and_dtype():
    config = _model_config(layers=3, kv_heads=2, head_dim=8)
    # 2 (K and V) * 16 slots * 2 heads * 8 dims * 4 bytes * 3 layers
    assert kv_cache_bytes_per_block(config, 16, torch.float32) == 2 * 16 * 2 * 8 * 4 * 3
    assert kv_cache_bytes_per_block(config, 16, torch.bfloat16) == 2 * 16 * 2 * 8 * 2 * 3


def test_num_blocks_is_memory_over_block_bytes():
    config = _model_config()
    block_bytes = kv_cache_bytes_per_block(config, 16, torch.float32)
    assert num_blocks_for(block_bytes * 100 + 7, config, 16, torch.float32, 256) == 100


def test_too_little_memory_for_one_max_len_request_names_the_flag():
    config = _model_config()
    block_bytes = kv_cache_bytes_per_block(config, 16, torch.float32)
    # max_model_len 257 needs ceil(257 / 16) = 17 blocks
    assert num_blocks_for(block_bytes * 17, config, 16, torch.float32, 257) == 17
    with pytest.raises(ConfigError, match="--kv-cache-memory-bytes"):
        num_blocks_for(block_bytes * 16, config, 16, torch.float32, 257)


def test_allocate_gives_one_zeroed_tensor_per_layer():
    config = _model_config(layers=3, kv_heads=2, head_dim=8)
    caches = spec_for(config, 4, torch.float32).allocate(5, "cpu").layers
    assert len(caches) == 3
    assert all(c.shape == (2, 5, 4, 2, 8) and c.dtype == torch.float32 for c in caches)
    assert all(not c.any() for c in caches)
    assert caches[0].data_ptr() != caches[1].data_ptr()


def test_available_memory_uses_explicit_bytes_when_set():
    assert available_kv_memory(CacheConfig(kv_cache_memory_bytes=12345), "cpu") == 12345


def test_available_memory_on_cpu_is_a_fraction_of_available_ram():
    tenth = available_kv_memory(CacheConfig(cpu_kv_cache_fraction=0.1), "cpu")
    fifth = available_kv_memory(CacheConfig(cpu_kv_cache_fraction=0.2), "cpu")
    assert 0 < tenth < fifth


@pytest.mark.parametrize("flags, bf16_checkpoint_runs_in", [
    (frozenset({"avx2"}), "float32"),
    (frozenset({"avx2", "avx512f", "avx512_bf16"}), "bfloat16"),
    (frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16"}), "bfloat16")])
def test_auto_dtype_follows_the_cpu_and_the_checkpoint(monkeypatch, flags,
                                                        bf16_checkpoint_runs_in):
    from foveal import cpu_features

    fake = cpu_features.CPUFeatures("test CPU", flags, "AVX2")
    monkeypatch.setattr(cpu_features, "cpu_features", lambda: fake)
    assert resolve_dtype("auto", "cpu", "bfloat16") == bf16_checkpoint_runs_in
    for stored in ("float32", "float16", None):  # fp16 has no fast CPU path
        assert resolve_dtype("auto", "cpu", stored) == "float32"
    assert resolve_dtype("bfloat16", "cpu", "float32") == "bfloat16"


def test_auto_dtype_on_cuda_keeps_half_checkpoints():
    assert resolve_dtype("auto", "cuda", None) == "bfloat16"
    assert resolve_dtype("auto", "cuda:0", torch.float32) == "bfloat16"
    assert resolve_dtype("auto", "cuda", "float16") == "float16"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert torch_dtype("float16") is torch.float16


def test_unknown_dtype_lists_the_accepted_names():
    with pytest.raises(ConfigError, match="float32, bfloat16, float16"):
        resolve_dtype("fp8", "cpu")


def test_devices_resolve_and_unknown_names_fail():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="--device"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match="--device cpu"):
        resolve_device("cuda:0")


def test_kv_cache_dtype_other_than_the_model_dtype_sizes_the_pool():
    config = _model_config(layers=3, kv_heads=2, head_dim=8)
    cache = CacheConfig(block_size=16, kv_cache_dtype="bfloat16", kv_cache_memory_bytes=1 << 20)
    spec = kv_cache_spec(config, cache, "float32")
    assert spec.dtype == torch.bfloat16
    assert spec.block_bytes == 2 * 16 * 2 * 8 * 2 * 3  # half the fp32 block
    num_blocks = spec.num_blocks_for(available_kv_memory(cache, "cpu"), 256)
    assert num_blocks == (1 << 20) // (2 * 16 * 2 * 8 * 2 * 3)
    caches = spec.allocate(num_blocks, "cpu")
    assert caches.layers[0].dtype == torch.bfloat16 and caches.scales is None
    assert sum(t.numel() * t.element_size() for t in caches.layers) == num_blocks * spec.block_bytes


def test_scales_are_counted_in_block_bytes_and_allocated_beside_each_layer():
    spec = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                       quantization="int8")
    # per layer: K and V int8 (2 * 4 * 2 * 8 * 1) + float16 scales (2 * 4 * 2 * 2)
    assert spec.block_bytes == 2 * (2 * 4 * 2 * 8 + 2 * 4 * 2 * 2)
    caches = spec.allocate(3, "cpu")
    assert caches.layers[0].dtype == torch.int8
    assert [t.shape for t in caches.scales] == [(2, 3, 4, 2)] * 2
    total = sum(t.numel() * t.element_size() for t in caches.layers + caches.scales)
    assert total == 3 * spec.block_bytes


def test_kv_heads_are_split_over_tensor_parallel_ranks_and_replicated_when_scarce():
    config = _model_config(kv_heads=2)
    assert kv_cache_spec(config, CacheConfig(), "float32", tp_size=2).num_kv_heads == 1
    assert kv_cache_spec(config, CacheConfig(), "float32", tp_size=4).num_kv_heads == 1
    assert kv_cache_spec(config, CacheConfig(), "float32", tp_size=1).num_kv_heads == 2


@pytest.mark.parametrize("head_dim", [64, 128])  # the small preset; Qwen2-VL-2B / 7B
def test_quantized_pools_hold_the_promised_token_multiples_scales_included(head_dim):
    config = _model_config(layers=28, kv_heads=2, head_dim=head_dim)
    memory = 1 << 30

    def tokens(dtype: str) -> int:
        cache = CacheConfig(block_size=16, kv_cache_dtype=dtype)
        return kv_cache_spec(config, cache, "float32").num_blocks_for(memory, 16) * 16

    for name, vs_16bit, vs_fp32 in (("int8", 1.9, 3.8), ("fp8_e4m3", 1.9, 3.8),
                                    ("int4", 3.6, 7.0)):
        assert tokens(name) >= vs_16bit * tokens("bfloat16"), name
        assert tokens(name) >= vs_fp32 * tokens("float32"), name


def test_sliding_window_groups_size_pages_by_the_layers_a_page_holds():
    """gemma-3-4b's pattern: 5 full layers, 29 sliding ones in 6 groups of 5; a page
    holds 5 layers, decoder layer l uses tensor slot_of(l); one max_model_len request
    needs its full blocks plus each sliding group's window and step, plus the null page."""
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(34)]
    groups = KVCacheGroups.for_layers(windows)
    spec = KVCacheSpec(num_layers=34, block_size=16, num_kv_heads=4, head_dim=256,
                       dtype=torch.bfloat16, groups=groups)
    per_layer = 2 * 16 * 4 * 256 * 2
    assert spec.num_tensors == 5 and spec.block_bytes == 5 * per_layer
    needed = 8192 // 16 + 6 * ((1023 + 2048) // 16 + 2) + 1
    assert spec.num_blocks_for(needed * spec.block_bytes, 8192, 2048) == needed
    with pytest.raises(ConfigError, match="needs"):
        spec.num_blocks_for((needed - 1) * spec.block_bytes, 8192, 2048)
    caches = spec.allocate(4, "cpu")
    layers, scales = caches.by_layer
    assert len(caches.layers) == 5 and len(layers) == 34 and scales is None
    assert layers[5] is caches.layers[0] and layers[11] is caches.layers[1]  # full layers
    assert layers[0] is caches.layers[0] and layers[33] is caches.layers[3]  # sliding ones


def test_gemma3_config_turns_into_groups_unless_disabled():
    text = TextConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-6,
                      rope_theta=1e4, mrope_section=(), max_position_embeddings=64,
                      tie_word_embeddings=True, layer_windows=(16, 0, 16, 0))
    config = dataclasses.replace(_model_config(), text=text)
    assert kv_cache_spec(config, CacheConfig(), "float32").groups.layers == ((1, 3), (0, 2))
    plain = CacheConfig(disable_hybrid_kv_cache_manager=True)
    assert kv_cache_spec(config, plain, "float32").groups is None
