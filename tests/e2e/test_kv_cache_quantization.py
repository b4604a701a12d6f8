"""Quantized KV cache (int8, fp8_e4m3, int4) end to end: accuracy against float
KV on the same weights, every cache feature giving the outputs of the same
quantized run without caching, capacity reporting, and bad configurations."""
from __future__ import annotations

import logging

import pytest

from foveal import LLM, SamplingParams
from foveal.bench.kv_accuracy import agreement, reference_run
from foveal.bench.workload import PromptVocab, WorkloadSpec, build_workload
from foveal.config import CacheConfig
from foveal.errors import ConfigError
from foveal.loader.hf_config import model_config_from_hf
from foveal.worker.kv_cache import kv_cache_spec
from tests.e2e.test_multimodal_caching import fingerprint, image, user

DTYPES = ("int8", "fp8_e4m3", "int4")
MIN_AGREEMENT = {"int8": 0.99, "fp8_e4m3": 0.98, "int4": 0.95}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


def same(outputs, expected) -> bool:
    """Identical greedy tokens; logprobs equal up to one quantization step.

    A recomputed or chunked K/V differs from the first computation in its last
    float bit (another GEMM shape); once in a while that moves a value across a
    rounding boundary of the KV codec (an fp8 step is 1/16 of the value), which
    shows in the logprobs, never in these greedy tokens.
    """
    return all([t for t, _ in fingerprint(a)] == [t for t, _ in fingerprint(b)]
               and [p for _, p in fingerprint(a)] == pytest.approx(
                   [p for _, p in fingerprint(b)], abs=1e-2)
               for a, b in zip(outputs, expected, strict=True))


def block_bytes(checkpoint: str, dtype: str) -> int:
    config = model_config_from_hf(checkpoint)
    return kv_cache_spec(config, CacheConfig(kv_cache_dtype=dtype), "float32").block_bytes


def make_llm(checkpoint: str, dtype: str, num_blocks: int = 256, **kwargs) -> LLM:
    options = dict(max_model_len=512, max_num_batched_tokens=256,
                   kv_cache_memory_bytes=num_blocks * block_bytes(checkpoint, dtype))
    return LLM(model=checkpoint, kv_cache_dtype=dtype, **{**options, **kwargs})


def run(llm: LLM, conversations, params: SamplingParams = GREEDY) -> list:
    return llm.chat(conversations, params, use_tqdm=False)


def metric(llm: LLM, name: str) -> float:
    return llm.get_metrics()[f"foveal:{name}"]


def test_teacher_forced_agreement_with_float_kv_over_1024_positions(checkpoint):
    spec = WorkloadSpec(num_prompts=4, images_per_prompt=1, image_size=(224, 168), input_len=16,
                        output_len=256, output_len_range=0.0, seed=0)
    prompts = [r.to_prompt() for r in build_workload(spec, PromptVocab.from_model_dir(checkpoint))]
    kwargs = dict(max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    reference = reference_run(LLM(model=checkpoint, **kwargs), prompts, 256)
    results = {dtype: agreement(LLM(model=checkpoint, kv_cache_dtype=dtype, **kwargs), prompts,
                                reference) for dtype in DTYPES}
    print({dtype: result.as_dict() for dtype, result in results.items()})
    for dtype, result in results.items():
        assert result.positions == 1024
        assert result.top1_agreement >= MIN_AGREEMENT[dtype], (dtype, result)
    diffs = [results[dtype].mean_abs_logit_diff for dtype in DTYPES]
    assert 0 < diffs[0] < diffs[1] < diffs[2]  # int8 < fp8 < int4


@pytest.fixture(scope="module", params=DTYPES)
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def llm_off(checkpoint, dtype) -> LLM:
    return make_llm(checkpoint, dtype, enable_prefix_caching=False)


def test_prefix_hit_and_chunked_prefill_through_the_image_match_an_uncached_run(
        checkpoint, dtype, llm_off):
    turn1 = [user("What is this?", image(17))]
    chunked = make_llm(checkpoint, dtype, max_num_batched_tokens=16)
    first = run(chunked, [turn1])[0]
    turn2 = turn1 + [{"role": "assistant", "content": first.outputs[0].text},
                     user("And its colour?")]
    second = run(chunked, [turn2])[0]
    assert second.num_cached_tokens >= 16
    assert same([first, second], run(llm_off, [turn1, turn2]))


def test_preemption_by_recompute_matches_an_uncached_run(checkpoint, dtype, llm_off):
    conversations = [[user(f"Look {i}.", image(20 * i))] for i in range(6)]
    longer = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    small = make_llm(checkpoint, dtype, num_blocks=12, max_model_len=128)
    outputs = run(small, conversations, longer)
    assert metric(small, "num_preemptions_total") > 0
    assert same(outputs, run(llm_off, conversations, longer))


def test_offload_tier_brings_back_quantized_blocks_with_their_scales(checkpoint, dtype, llm_off):
    bytes_per_block = block_bytes(checkpoint, dtype)
    llm = make_llm(checkpoint, dtype, num_blocks=10, max_model_len=128, kv_offload="cpu",
                   kv_offload_bytes=64 * bytes_per_block)
    conversation = [user("What is in this picture, in detail?", image(9))]
    first = run(llm, [conversation])[0]
    for color in range(120, 126):
        run(llm, [[user(f"Other {color}.", image(color))]])
    again = run(llm, [conversation])[0]
    assert metric(llm, "kv_offload_hits_total") > 0
    assert again.num_cached_tokens >= 16
    assert fingerprint(again) == fingerprint(first)
    assert same([again], run(llm_off, [conversation]))


def test_metrics_and_start_log_report_dtype_and_capacity(checkpoint, caplog):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("foveal").addHandler(handler)
    try:
        llm = make_llm(checkpoint, "int8", num_blocks=100)
    finally:
        logging.getLogger("foveal").removeHandler(handler)
    assert metric(llm, "kv_cache_capacity_tokens") == 100 * 16
    assert llm.get_metrics()['foveal:kv_cache_info{kv_cache_dtype="int8"}'] == 1
    assert any("KV cache: 1,600 tokens (int8)" in r.getMessage() for r in records)


def test_unknown_kv_dtype_is_a_config_error(checkpoint):
    with pytest.raises(ConfigError, match="int8"):
        LLM(model=checkpoint, kv_cache_dtype="int3")


def test_fp8_without_float8_in_torch_is_a_config_error(checkpoint, monkeypatch):
    from foveal.layers.attention import kv_quant

    monkeypatch.delitem(kv_quant._CODECS, "fp8_e4m3")
    with pytest.raises(ConfigError, match="float8"):
        LLM(model=checkpoint, kv_cache_dtype="fp8")


def checkpoint_with_kv_scales(source: str, folder, scale_for_layer) -> str:
    """A copy of the checkpoint whose attention layers carry k_scale / v_scale tensors."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    target = folder / "with_scales"
    shutil.copytree(source, target)
    weights = load_file(str(target / "model.safetensors"))
    layers = sorted({name.split(".self_attn.")[0] for name in weights if ".self_attn." in name})
    for prefix in layers:
        for kind in ("k_scale", "v_scale"):
            weights[f"{prefix}.self_attn.{kind}"] = torch.as_tensor(scale_for_layer(kind))
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return str(target)


def attention_layers(llm: LLM) -> list:
    from foveal.layers.attention import Attention

    model = llm.llm_engine.core.executor.model_runner.model
    return [m for m in model.modules() if isinstance(m, Attention)]


def test_fp8_uses_the_checkpoints_per_head_scales(checkpoint, tmp_path):
    scales = {"k_scale": [0.02, 0.03], "v_scale": [0.01, 0.015]}
    path = checkpoint_with_kv_scales(checkpoint, tmp_path, lambda kind: scales[kind])
    llm = LLM(model=path, kv_cache_dtype="fp8_e4m3", max_model_len=256,
              kv_cache_memory_bytes=1 << 20)
    layers = attention_layers(llm)
    assert len(layers) == 2
    for layer in layers:
        k_scale, v_scale = layer.static_kv_scales
        assert k_scale.tolist() == pytest.approx(scales["k_scale"])
        assert v_scale.tolist() == pytest.approx(scales["v_scale"])
    out = run(llm, [[user("What is this?", image(3))]])[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    # Other KV dtypes read the scales and leave them unused.
    plain = LLM(model=path, max_model_len=256, kv_cache_memory_bytes=1 << 20)
    assert all(layer.static_kv_scales is None for layer in attention_layers(plain))


def test_checkpoint_kv_scale_of_the_wrong_shape_is_a_config_error(checkpoint, tmp_path):
    path = checkpoint_with_kv_scales(checkpoint, tmp_path, lambda kind: [0.1, 0.1, 0.1])
    with pytest.raises(ConfigError, match="expected 1 or one per KV head"):
        LLM(model=path, kv_cache_dtype="fp8", max_model_len=256, kv_cache_memory_bytes=1 << 20)
