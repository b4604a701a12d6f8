"""Pre-quantized checkpoints (GPTQ, AWQ, fp8) dequantized at load time.

The tiny checkpoint's text-decoder linear weights are quantized here and packed by
a reference packer written from the format descriptions (independent of the
loader's unpacking); the loader must give back exactly the reference
dequantization, the engine the same tokens as a float checkpoint holding those
weights, and malformed checkpoints must fail naming the tensor."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from foveal import LLM, SamplingParams
from foveal.config import CHECKPOINT_METHOD_NAMES
from foveal.errors import CheckpointError, ConfigError
from foveal.layers.quantization import check_quantization
from foveal.loader.hf_config import model_config_from_hf
from foveal.loader.quantized import dequantized_checkpoint
from foveal.loader.weights import iterate_checkpoint
from tests.e2e.test_multimodal_caching import image, user

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
OPTIONS = {"max_model_len": 512, "kv_cache_memory_bytes": 1 << 21, "max_num_batched_tokens": 256}
_QUANTIZED = re.compile(r"language_model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # word position i holds column 8c + _AWQ_ORDER[i]


def pack_words(values: np.ndarray, bits: int, axis: int) -> torch.Tensor:
    """Unsigned ints -> int32 words, 32 // bits consecutive values along `axis`
    per word, the first in the lowest bits."""
    pack = 32 // bits
    values = np.moveaxis(values.astype(np.uint64), axis, 0)
    words = np.zeros((values.shape[0] // pack,) + values.shape[1:], dtype=np.uint64)
    for j in range(pack):
        words |= values[j::pack] << np.uint64(bits * j)
    return torch.from_numpy(np.moveaxis(words, 0, axis).astype(np.uint32).view(np.int32).copy())


def quantize_groups(weight: torch.Tensor, g_idx: np.ndarray, groups: int, bits: int, sym: bool):
    """weight (out, in) -> q (in, out), zeros (groups, out), fp16 scales (groups, out)."""
    maxq = 2 ** bits - 1
    w = weight.T.double().numpy()  # (in, out)
    low = np.stack([np.minimum(w[g_idx == g].min(0), 0) for g in range(groups)])
    high = np.stack([np.maximum(w[g_idx == g].max(0), 0) for g in range(groups)])
    if sym:
        high = np.maximum(-low, high)
        low = -high
    scales = torch.from_numpy((high - low) / maxq).clamp_min(1e-6).half()
    s = scales.double().numpy()
    zeros = np.full(s.shape, (maxq + 1) // 2) if sym else np.clip(np.round(-low / s), 0, maxq)
    q = np.clip(np.round(w / s[g_idx]) + zeros[g_idx], 0, maxq)
    return q.astype(np.int64), zeros.astype(np.int64), scales


def reference_dequantization(q, zeros, scales, g_idx) -> torch.Tensor:
    """(out, in) float32: scale * (q - zero), each input channel with its group."""
    s = scales.float().numpy()
    return torch.from_numpy((s[g_idx] * (q - zeros[g_idx]).astype(np.float32)).T.copy())


def gptq_tensors(weight, bits=4, group_size=32, sym=False, desc_act=False, v1=True, seed=0):
    in_features = weight.shape[1]
    groups = 1 if group_size == -1 else in_features // group_size
    g_idx = np.arange(in_features) // (in_features if group_size == -1 else group_size)
    if desc_act:  # channels quantized in a permuted order: their groups are permuted too
        g_idx = g_idx[np.random.default_rng(seed).permutation(in_features)]
    q, zeros, scales = quantize_groups(weight, g_idx, groups, bits, sym)
    stored_zeros = zeros - 1 if v1 else zeros
    tensors = {"qweight": pack_words(q, bits, 0),
               "qzeros": pack_words(stored_zeros & (2 ** bits - 1), bits, 1),
               "scales": scales, "g_idx": torch.from_numpy(g_idx.astype(np.int32))}
    return tensors, reference_dequantization(q, zeros, scales, g_idx)


def awq_tensors(weight, group_size=32):
    in_features = weight.shape[1]
    g_idx = np.arange(in_features) // group_size
    q, zeros, scales = quantize_groups(weight, g_idx, in_features // group_size, 4, sym=False)
    order = np.arange(q.shape[1]).reshape(-1, 8)[:, _AWQ_ORDER].reshape(-1)  # word position
    tensors = {"qweight": pack_words(q[:, order], 4, 1), "qzeros": pack_words(zeros[:, order], 4, 1),
               "scales": scales}
    return tensors, reference_dequantization(q, zeros, scales, g_idx)


def fp8_tensors(weight, block_size=None, per_channel=False, block_scale_name="weight_scale_inv"):
    out_features, in_features = weight.shape
    if block_size:
        rows, cols = block_size
        blocks = weight.reshape(out_features // rows, rows, in_features // cols, cols)
        scale = blocks.abs().amax(dim=(1, 3)) / 448  # (out / rows, in / cols)
        per_element = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        name = block_scale_name
    else:
        scale = weight.abs().amax(1, keepdim=True) / 448 if per_channel else weight.abs().max() / 448
        per_element, name = scale, "weight_scale"
    stored = (weight / per_element).to(torch.float8_e4m3fn)
    tensors = {"weight": stored, name: scale.float(), "input_scale": torch.tensor(1.0)}
    return tensors, stored.float() * per_element


def write_quantized(source: str, out: Path, quantize, quantization_config: dict) -> dict:
    """A copy of `source` with its text linear weights replaced by quantize(weight)'s
    tensors; returns the reference dequantized weights by checkpoint name."""
    shutil.copytree(source, out)
    tensors, reference = {}, {}
    for name, weight in load_file(out / "model.safetensors").items():
        if not _QUANTIZED.search(name):
            tensors[name] = weight
            continue
        parts, reference[name] = quantize(weight)
        prefix = name.removesuffix(".weight")
        tensors.update({f"{prefix}.{part}": t for part, t in parts.items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    return reference


def write_float(source: str, out: Path, reference: dict) -> None:
    """A float checkpoint holding the reference dequantized weights."""
    shutil.copytree(source, out)
    tensors = {**load_file(out / "model.safetensors"), **reference}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def loaded_weights(path: Path, seed: int | None = None) -> dict[str, torch.Tensor]:
    """The loader's stream; with a seed, the checkpoint's tensors in a shuffled order
    (a layer's parts may come from different shards, in any order)."""
    spec = model_config_from_hf(str(path)).checkpoint_quantization
    stream = list(iterate_checkpoint(str(path)))
    if seed is not None:
        stream = [stream[i] for i in np.random.default_rng(seed).permutation(len(stream))]
    return dict(dequantized_checkpoint(stream, spec, torch.float32))


def _compressed_tensors(weights: dict) -> dict:
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, **weights}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head", "re:visual.*"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme,
                                          "input_activations": {"num_bits": 8, "type": "float",
                                                                "strategy": "token",
                                                                "dynamic": True}}}}


FORMATS = {
    "gptq4-g32": (lambda w: gptq_tensors(w), {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                              "sym": False, "desc_act": False}),
    "gptq4-sym-desc_act": (lambda w: gptq_tensors(w, sym=True, desc_act=True),
                           {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                            "desc_act": True}),
    "gptq4-per-row-v2": (lambda w: gptq_tensors(w, group_size=-1, v1=False),
                         {"quant_method": "gptq", "bits": 4, "group_size": -1,
                          "checkpoint_format": "gptq_v2"}),
    "gptq8-g64": (lambda w: gptq_tensors(w, bits=8, group_size=64),
                  {"quant_method": "gptq", "bits": 8, "group_size": 64}),
    "awq4-g32": (lambda w: awq_tensors(w), {"quant_method": "awq", "bits": 4, "group_size": 32,
                                            "zero_point": True, "version": "gemm"}),
    "fp8-block": (lambda w: fp8_tensors(w, block_size=(16, 32)),
                  {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 32],
                   "activation_scheme": "dynamic"}),
    "fp8-per-tensor": (lambda w: fp8_tensors(w), {"quant_method": "fp8",
                                                  "activation_scheme": "static"}),
    "fp8-per-channel": (lambda w: fp8_tensors(w, per_channel=True), {"quant_method": "fp8"}),
    "fp8-compressed-tensors-channel": (lambda w: fp8_tensors(w, per_channel=True),
                                       _compressed_tensors({"strategy": "channel"})),
    "fp8-compressed-tensors-block": (
        lambda w: fp8_tensors(w, block_size=(32, 32), block_scale_name="weight_scale"),
        _compressed_tensors({"strategy": "block", "block_structure": [32, 32]})),
}


# the largest rounding error of each format, as a fraction of the weight's abs max
_STEPS = {"gptq4": 7, "awq4": 7, "gptq8": 100, "fp8": 8}


@pytest.fixture(scope="module")
def source(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_loader_gives_the_reference_dequantization_within_a_step_of_the_float_weights(
        fmt, source, tmp_path):
    quantize, config = FORMATS[fmt]
    reference = write_quantized(source, tmp_path / fmt, quantize, config)
    loaded = loaded_weights(tmp_path / fmt)
    original = load_file(Path(source) / "model.safetensors")
    assert len(reference) == 14  # 2 layers x 7 projections
    for name, want in reference.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], want), name
        error = (want - original[name]).abs().max()
        step = original[name].abs().max() / _STEPS[fmt.split("-")[0]]
        assert 0 < error <= step, name
    assert not any(n.endswith(("qweight", "qzeros", "scales", "g_idx", "_scale", "_scale_inv"))
                   for n in loaded)
    assert torch.equal(loaded["model.visual.blocks.0.attn.qkv.weight"],
                       original["model.visual.blocks.0.attn.qkv.weight"])  # not quantized
    shuffled = loaded_weights(tmp_path / fmt, seed=1)
    assert shuffled.keys() == loaded.keys()
    assert all(torch.equal(shuffled[name], loaded[name]) for name in loaded)
    assert model_config_from_hf(str(tmp_path / fmt)).checkpoint_quantization.method == (
        "fp8" if fmt.startswith("fp8") else fmt[:4].rstrip("4"))


def test_a_gptq_checkpoint_without_g_idx_groups_channels_in_order(source, tmp_path):
    quantize, config = FORMATS["gptq4-g32"]
    reference = write_quantized(source, tmp_path / "gptq", quantize, config)
    _damage(tmp_path / "gptq", lambda t: [t.pop(n) for n in list(t) if n.endswith(".g_idx")])
    loaded = loaded_weights(tmp_path / "gptq")
    assert all(torch.equal(loaded[name], want) for name, want in reference.items())


def test_loading_into_bfloat16_rounds_the_dequantized_weights_once(source, tmp_path):
    quantize, config = FORMATS["awq4-g32"]
    reference = write_quantized(source, tmp_path / "awq", quantize, config)
    spec = model_config_from_hf(str(tmp_path / "awq")).checkpoint_quantization
    loaded = dict(dequantized_checkpoint(iterate_checkpoint(str(tmp_path / "awq")), spec,
                                         torch.bfloat16))
    assert all(torch.equal(loaded[name], want.bfloat16()) for name, want in reference.items())


@pytest.mark.parametrize("fmt", ["gptq4-sym-desc_act", "awq4-g32", "fp8-block"])
def test_engine_gives_the_tokens_of_a_float_checkpoint_with_the_same_weights(fmt, source, tmp_path):
    quantize, config = FORMATS[fmt]
    reference = write_quantized(source, tmp_path / "quantized", quantize, config)
    write_float(source, tmp_path / "float", reference)
    chats = [[user("describe the picture", image(60))], [{"role": "user", "content": "count"}]]
    outputs = []
    for folder in ("quantized", "float"):
        llm = LLM(model=str(tmp_path / folder), **OPTIONS)
        outputs.append([[(t, step[t].logprob) for t, step in
                         zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                        for o in llm.chat(chats, GREEDY, use_tqdm=False)])
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 8 for tokens in outputs[0])


@pytest.mark.parametrize("fmt,names", [("gptq4-g32", ("gptq", "gptq_marlin")),
                                       ("awq4-g32", ("awq", "awq_marlin")),
                                       ("fp8-block", ("fp8", "compressed-tensors"))])
def test_quantization_may_name_the_checkpoints_own_method(fmt, names, source, tmp_path):
    """vLLM's spelling (--quantization gptq on a GPTQ checkpoint) loads the checkpoint as
    it is, with the tokens of no flag; a name that is not the checkpoint's method is a
    ConfigError, and so is one on a float checkpoint."""
    quantize, config = FORMATS[fmt]
    write_quantized(source, tmp_path / "quantized", quantize, config)
    chats = [[user("describe the picture", image(60))]]

    def tokens(llm: LLM) -> list[int]:
        return llm.chat(chats, GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    folder = str(tmp_path / "quantized")
    expected = tokens(LLM(model=folder, **OPTIONS))
    assert tokens(LLM(model=folder, quantization=names[0], **OPTIONS)) == expected
    method = model_config_from_hf(folder).checkpoint_quantization.method
    for alias in names:
        assert check_quantization(alias, "cpu", method) is None
        assert check_quantization(alias, "cuda", method) is None
        with pytest.raises(ConfigError, match="is not quantized"):
            check_quantization(alias, "cpu", None)
    other = next(name for name in CHECKPOINT_METHOD_NAMES if CHECKPOINT_METHOD_NAMES[name] != method)
    with pytest.raises(ConfigError, match=f"this checkpoint is a {method} checkpoint"):
        LLM(model=folder, quantization=other, **OPTIONS)
    with pytest.raises(ConfigError, match="is not quantized"):
        LLM(model=source, quantization=names[0], **OPTIONS)


def test_int8_requantization_of_a_gptq_checkpoint_matches_that_of_its_float_twin(source, tmp_path):
    quantize, config = FORMATS["gptq4-g32"]
    reference = write_quantized(source, tmp_path / "quantized", quantize, config)
    write_float(source, tmp_path / "float", reference)
    chats = [[user("what colour is it", image(90))]]
    outputs = []
    for folder in ("quantized", "float"):
        llm = LLM(model=str(tmp_path / folder), quantization="int8", **OPTIONS)
        model = llm.llm_engine.core.executor.model_runner.model
        assert model.language_model.layers[0].mlp.down_proj.int8_weight is not None
        completion = llm.chat(chats, GREEDY, use_tqdm=False)[0].outputs[0]
        outputs.append([(t, step[t].logprob) for t, step in zip(completion.token_ids,
                                                                 completion.logprobs)])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


def test_two_ranks_load_a_gptq_checkpoint_and_give_the_tokens_of_one(source, tmp_path):
    quantize, config = FORMATS["gptq4-sym-desc_act"]
    write_quantized(source, tmp_path / "gptq", quantize, config)
    chats = [[user("describe the picture", image(30))], [{"role": "user", "content": "hello"}]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.chat(chats, greedy, use_tqdm=False)]

    expected = tokens(LLM(model=str(tmp_path / "gptq"), **OPTIONS))
    llm = LLM(model=str(tmp_path / "gptq"), tensor_parallel_size=2, **OPTIONS)
    try:
        assert tokens(llm) == expected
    finally:
        llm.shutdown()


def _damage(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


_LAYER = "model.language_model.layers.1.mlp.down_proj"


@pytest.mark.parametrize("fmt, edit, message", [
    ("gptq4-g32", lambda t: t.pop(f"{_LAYER}.scales"), rf"lacks {_LAYER}\.scales"),
    ("gptq4-sym-desc_act", lambda t: t.pop(f"{_LAYER}.g_idx"), rf"lacks {_LAYER}\.g_idx"),
    ("gptq4-g32", lambda t: t.update({f"{_LAYER}.qzeros": t[f"{_LAYER}.qzeros"][:, :4]}),
     rf"{_LAYER}\.qzeros has shape \(4, 4\)"),
    ("gptq4-g32", lambda t: t.update({f"{_LAYER}.g_idx": t[f"{_LAYER}.g_idx"] + 9}),
     rf"{_LAYER}\.g_idx names groups outside"),
    ("awq4-g32", lambda t: t.update({f"{_LAYER}.scales": t[f"{_LAYER}.scales"][:2]}),
     rf"{_LAYER}\.scales has 2 groups"),
    ("fp8-block", lambda t: t.pop(f"{_LAYER}.weight_scale_inv"), rf"lacks {_LAYER}\.weight_scale"),
    ("fp8-block", lambda t: t.update({f"{_LAYER}.weight_scale_inv": torch.ones(3, 3)}),
     rf"{_LAYER}\.weight_scale_inv has shape \(3, 3\)"),
])
def test_malformed_quantized_checkpoints_name_the_tensor(fmt, edit, message, source, tmp_path):
    quantize, config = FORMATS[fmt]
    write_quantized(source, tmp_path / "bad", quantize, config)
    _damage(tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        LLM(model=str(tmp_path / "bad"), **OPTIONS)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "bits=3"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quantized \(bitsandbytes\).*GPTQ"),
    ({"quant_method": "exl2"}, r"quantized \(exl2\)"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}, "'pack-quantized'"),
])
def test_unsupported_quantization_configs_are_config_errors(config, message, source, tmp_path):
    shutil.copytree(source, tmp_path / "q")
    hf = json.loads((tmp_path / "q" / "config.json").read_text())
    (tmp_path / "q" / "config.json").write_text(json.dumps({**hf, "quantization_config": config}))
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf(str(tmp_path / "q"))
