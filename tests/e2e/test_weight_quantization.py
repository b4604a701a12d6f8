"""--quantization int8 (W8A8, dynamic activations; the exact per-token kernel or
FBGEMM's, by CPU): the kernels against float math, the choice, batch invariance,
accuracy against the float model by teacher forcing, every cache feature giving the same answers as a plain int8 run, and
the configurations it refuses."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from foveal import LLM, SamplingParams
from foveal.bench.kv_accuracy import agreement, reference_run
from foveal.bench.workload import PromptVocab, WorkloadSpec, build_workload
from foveal.errors import ConfigError
from foveal.layers.linear import LinearBase, ReplicatedLinear, apply_linear
from foveal.layers.quantization import (check_quantization, int8_kernel, int8_linear, pack_fbgemm,
                                        quantize_int8)
from tests.e2e.test_multimodal_caching import image, same, user

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


@pytest.fixture
def int8_kernel_is(monkeypatch):
    """Pins the int8 kernel (the engine picks one by CPU) for one test."""
    def pin(kernel: str) -> None:
        monkeypatch.setenv("FOVEAL_INT8_KERNEL", kernel)
        int8_kernel.cache_clear()
    yield pin
    int8_kernel.cache_clear()


@pytest.mark.parametrize("kernel,tolerance", [("exact", 0.02), ("fbgemm", 0.04)])
def test_int8_linear_matches_float_math_within_quantization_error(kernel, tolerance):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 72) * 0.05, torch.randn(96)
    x = torch.randn(2, 5, 72)
    qweight, scale = quantize_int8(weight)
    packed = pack_fbgemm(qweight, scale) if kernel == "fbgemm" else None
    assert qweight.dtype == torch.int8 and qweight.abs().max() == 127
    got, want = int8_linear(x, qweight, scale, bias, packed), x @ weight.T + bias
    assert got.shape == want.shape == (2, 5, 96)
    error = (got - want).abs().max() / want.abs().max()
    assert 0 < error < tolerance
    assert int8_linear(x.bfloat16(), qweight, scale, bias, packed).dtype == torch.bfloat16
    assert int8_linear(x[:, :0], qweight, scale, None, packed).shape == (2, 0, 96)


def test_the_kernel_follows_the_cpus_int8_instructions(monkeypatch, int8_kernel_is):
    from foveal import cpu_features as features

    def cpu(*flags):
        return features.CPUFeatures("test CPU", frozenset({"avx2", *flags}), "AVX2")

    for flags, expected in ((("avx512_vnni",), "exact"), (("avx_vnni",), "exact"),
                            (("amx_int8",), "exact"), ((), "fbgemm")):
        monkeypatch.setattr(features, "cpu_features", lambda flags=flags: cpu(*flags))
        int8_kernel_is("auto")
        assert int8_kernel() == expected, flags
    int8_kernel_is("exact")
    assert int8_kernel() == "exact"  # no VNNI, but asked for
    int8_kernel_is("int4")
    with pytest.raises(ConfigError, match="FOVEAL_INT8_KERNEL"):
        int8_kernel()


def test_a_rows_result_does_not_depend_on_the_other_rows():
    torch.manual_seed(1)
    qweight, scale = quantize_int8(torch.randn(64, 48))
    rows = torch.randn(9, 48)
    rows[3] *= 100  # an outlier token must not change its neighbours' scales
    batch = int8_linear(rows, qweight, scale, None)
    for i in range(len(rows)):
        assert torch.equal(batch[i], int8_linear(rows[i:i + 1], qweight, scale, None)[0])


def test_quantized_layer_releases_its_dense_weight():
    from foveal.layers.quantization import quantize_weights

    layer = ReplicatedLinear(32, 16, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(4, 32)
    dense = apply_linear(x, layer, layer.bias)
    assert quantize_weights(torch.nn.Sequential(layer), "int8") == 1
    assert layer.weight.numel() == 0 and layer.int8_weight.shape == (16, 32)
    assert (apply_linear(x, layer, layer.bias) - dense).abs().max() < 0.05 * dense.abs().max()


@pytest.mark.parametrize("kernel", ["exact", "fbgemm"])
def test_an_int8_layer_holds_one_byte_per_weight(kernel, int8_kernel_is):
    """The exact kernel reads the plain int8 weight; FBGEMM reads its packing alone, so
    the plain weight is only a shape there (no second int8 copy)."""
    from foveal.layers.quantization import quantize_weights

    int8_kernel_is(kernel)
    layer = ReplicatedLinear(64, 48, bias=False)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(5, 64)
    dense = apply_linear(x, layer, None)
    quantize_weights(torch.nn.Sequential(layer), "int8")
    assert layer.int8_weight.shape == (48, 64) and layer.int8_weight.dtype == torch.int8
    assert (layer.int8_weight.device.type == "meta") == (kernel == "fbgemm")
    assert (layer.int8_fbgemm is not None) == (kernel == "fbgemm")
    assert (apply_linear(x, layer, None) - dense).abs().max() < 0.05 * dense.abs().max()


def test_the_engine_quantizes_every_linear_layer_but_not_the_head(checkpoint):
    llm = LLM(model=checkpoint, quantization="int8", max_model_len=256,
              kv_cache_memory_bytes=4 << 20)
    model = llm.llm_engine.core.executor.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.int8_weight is not None for m in linears)
    head = model.lm_head if hasattr(model, "lm_head") else model.language_model.lm_head
    assert head.weight.numel() > 0 and getattr(head, "int8_weight", None) is None


def test_quantize_lm_head_gives_the_head_an_int8_copy(checkpoint):
    llm = LLM(model=checkpoint, quantization="int8", quantize_lm_head=True, max_model_len=256,
              kv_cache_memory_bytes=4 << 20)
    model = llm.llm_engine.core.executor.model_runner.model
    head = model.lm_head if hasattr(model, "lm_head") else model.language_model.lm_head
    assert head.int8_weight.dtype == torch.int8 and head.int8_weight.shape == head.weight.shape
    assert head.packed_weight is None  # forward() reads the int8 copy, nothing else
    hidden = torch.randn(3, head.weight.shape[1])
    logits = head(hidden)
    dense = hidden @ head.weight.T
    assert 0 < (logits - dense).abs().max() < 0.05 * dense.abs().max()


@pytest.mark.parametrize("kernel", ["exact", "fbgemm"])
def test_teacher_forced_agreement_with_float_weights(checkpoint, kernel, int8_kernel_is):
    int8_kernel_is(kernel)
    spec = WorkloadSpec(num_prompts=3, images_per_prompt=1, image_size=(112, 84), input_len=16,
                        output_len=96, output_len_range=0.0, seed=3)
    prompts = [r.to_prompt() for r in build_workload(spec, PromptVocab.from_model_dir(checkpoint))]
    kwargs = dict(max_model_len=512, kv_cache_memory_bytes=16 << 20)
    reference = reference_run(LLM(model=checkpoint, **kwargs), prompts, 96)
    result = agreement(LLM(model=checkpoint, quantization="int8", **kwargs), prompts, reference)
    print(result.as_dict())
    assert result.positions == 288
    assert result.top1_agreement >= 0.9
    assert 0 < result.mean_abs_logit_diff
    with_head = agreement(LLM(model=checkpoint, quantization="int8", quantize_lm_head=True, **kwargs),
                          prompts, reference)
    print(with_head.as_dict())
    assert with_head.top1_agreement >= 0.9
    assert with_head.mean_abs_logit_diff != result.mean_abs_logit_diff  # the head is quantized


def test_chunked_prefill_and_cache_hits_give_a_plain_int8_runs_answers(checkpoint, int8_kernel_is):
    int8_kernel_is("exact")  # FBGEMM's activation scale spans the step's rows
    options = dict(quantization="int8", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    plain = LLM(model=checkpoint, enable_prefix_caching=False, **options)
    cached = LLM(model=checkpoint, max_num_batched_tokens=24, **options)
    turn1 = [user("What is this?", image(17, (112, 84)))]
    first = cached.chat([turn1], GREEDY, use_tqdm=False)[0]
    turn2 = turn1 + [{"role": "assistant", "content": first.outputs[0].text},
                     user("And its colour?")]
    second = cached.chat([turn2], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    expected = [plain.chat([c], GREEDY, use_tqdm=False)[0] for c in (turn1, turn2)]
    assert same([first, second], expected)
    batched = cached.chat([turn1, turn2], GREEDY, use_tqdm=False)
    assert same(batched, expected)


def test_refused_configurations(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="--quantization"):
        check_quantization("int4", "cpu")
    with pytest.raises(ConfigError, match="CPU only"):
        check_quantization("int8", "cuda")
    assert check_quantization(None, "cuda") is None
    with pytest.raises(ConfigError, match="quantize_lm_head needs"):
        LLM(model=checkpoint, quantize_lm_head=True)
    quantized = tmp_path / "bitsandbytes"
    shutil.copytree(checkpoint, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"quantized \(bitsandbytes\).*GPTQ"):
        LLM(model=str(quantized))
