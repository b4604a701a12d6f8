"""Qwen3-VL-MoE (sparse expert MLPs in the Qwen3-VL decoder) equals transformers:
the router and experts layer against transformers' block, both checkpoint
orientations of the fused expert weights, and through the whole engine greedy
tokens and logprobs for a mixed batch with chunks through image ranges, a video,
cache hits, and tensor parallelism."""
from __future__ import annotations

import pytest
import torch

from foveal import LLM
from foveal.errors import CheckpointError
from foveal.layers.moe import FusedExperts, SparseMoeBlock
from tests.models.test_qwen3_vl_engine import (
    GREEDY, KV_BYTES, _assert_match, _frames, _image, _prompt,
)

PRESET = "tiny-qwen3-vl-moe"


@pytest.fixture(scope="module")
def setup(tiny_checkpoints):
    import transformers

    path = tiny_checkpoints(PRESET)
    hf_model, info = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    return path, hf_model.eval()


@torch.no_grad()
def test_sparse_block_equals_transformers():
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    torch.manual_seed(0)
    config = Qwen3VLMoeTextConfig(hidden_size=32, moe_intermediate_size=24, num_experts=6,
                                  num_experts_per_tok=3)
    theirs = Qwen3VLMoeTextSparseMoeBlock(config)
    for param in theirs.parameters():
        param.normal_(0, 0.3)
    ours = SparseMoeBlock(32, 24, 6, 3, "silu")
    ours.gate.weight.copy_(theirs.gate.weight)
    for name in ("gate_up_proj", "down_proj"):
        param = getattr(ours.experts, name)
        param.weight_loader(param, getattr(theirs.experts, name))
    x = torch.randn(9, 32)
    torch.testing.assert_close(ours(x), theirs(x[None])[0], atol=1e-5, rtol=1e-5)
    # a token's output does not depend on the batch it rides in
    torch.testing.assert_close(ours(x[4:5]), ours(x)[4:5], atol=1e-6, rtol=0)


@torch.no_grad()
def test_fixed_shape_dispatch_of_decode_graphs_equals_the_grouped_one():
    """Under static_shapes (the decode graphs' steps) the experts run as gathered,
    batched GEMMs of fixed shape: the same outputs as the host-sized grouped loop,
    for tokens that share experts and tokens that do not."""
    from foveal.forward_context import forward_context

    torch.manual_seed(0)
    experts = FusedExperts(6, 16, 10, "silu")
    experts.gate_up_proj.normal_(0, 0.3)
    experts.down_proj.normal_(0, 0.3)
    x = torch.randn(5, 16)
    chosen = torch.tensor([[0, 3], [3, 0], [5, 1], [2, 2], [4, 1]])
    weights = torch.rand(5, 2)
    grouped = experts(x, chosen, weights)
    with forward_context(None, [], static_shapes=True):
        static = experts(x, chosen, weights)
    torch.testing.assert_close(static, grouped, atol=1e-6, rtol=1e-5)
    assert static.shape == (5, 16) and static.abs().sum() > 0


def test_expert_weights_load_in_either_orientation_and_reject_other_shapes():
    experts = FusedExperts(4, 16, 6, "silu")
    gate_up = torch.randn(4, 12, 16)
    experts.gate_up_proj.weight_loader(experts.gate_up_proj, gate_up.transpose(1, 2))
    assert torch.equal(experts.gate_up_proj.data, gate_up)
    down = torch.randn(4, 16, 6)
    experts.down_proj.weight_loader(experts.down_proj, down.transpose(1, 2).contiguous())
    assert torch.equal(experts.down_proj.data, down)
    with pytest.raises(CheckpointError, match="gate_up_proj"):
        experts.gate_up_proj.weight_loader(experts.gate_up_proj, torch.randn(4, 10, 16))


def test_mixed_batch_with_chunks_and_a_video_matches_transformers(setup):
    path, hf_model = setup
    llm = LLM(model=path, max_model_len=1024, max_num_batched_tokens=24, max_num_seqs=4,
              block_size=16, kv_cache_memory_bytes=KV_BYTES)
    images = {"one": [_image(256, 200, 1)], "two": [_image(96, 224, 2), _image(250, 90, 3)]}
    conversations = [[{"role": "user", "content": [{"type": "image"}] * len(v) + [
        {"type": "text", "text": f"Describe {k}."}]}] for k, v in images.items()]
    prompts = [_prompt(llm, c, {"image": v}) for c, v in zip(conversations, images.values())]
    prompts.insert(1, {"prompt": "Hello there, how are you?"})
    video = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]}]
    prompts.append(_prompt(llm, video, {"video": {"frames": _frames(4, 96, 64, seed=4), "fps": 1.0}}))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _assert_match(llm, hf_model, prompts, outputs)
    # the same image again: prefix and encoder caches, same answer
    again = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert llm.get_metrics()["foveal:prefix_cache_hits_total"] > 0


def test_tensor_parallel_experts_give_the_single_rank_answers(setup):
    path, _ = setup
    prompts = [{"prompt": "Hello there, how are you?"}, {"prompt": "Count to ten, slowly."}]
    outputs = {}
    for tp in (1, 2):
        llm = LLM(model=path, max_model_len=256, tensor_parallel_size=tp,
                  kv_cache_memory_bytes=KV_BYTES)
        outputs[tp] = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        llm.shutdown()
    for single, split in zip(outputs[1], outputs[2]):
        assert split.token_ids == single.token_ids
        for a, b in zip(single.logprobs, split.logprobs):
            token = next(iter(a))
            assert abs(a[token].logprob - b[token].logprob) < 1e-4


def test_30b_a3b_preset_has_the_checkpoint_shapes():
    """`--dummy qwen3-vl-30b-a3b`: the same parameters as transformers' model of the config."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from foveal.loader.hf_config import model_config_from_dict
    from foveal.loader.presets import get_preset
    from foveal.models.qwen3_vl import Qwen3VLForConditionalGeneration as Ours

    preset = get_preset("qwen3-vl-30b-a3b")
    with torch.device("meta"):
        ours = Ours(model_config_from_dict(preset))
        theirs = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**preset))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())
    assert 31.0e9 < count < 31.2e9
    shapes = {n: tuple(p.shape) for n, p in ours.named_parameters() if "layers.0.mlp" in n}
    assert shapes["language_model.layers.0.mlp.experts.gate_up_proj"] == (128, 1536, 2048)


@torch.no_grad()
@pytest.mark.parametrize("kernel", ["exact", "fbgemm"])
def test_int8_experts_match_float_within_quantization_error(kernel, monkeypatch):
    from foveal.layers.quantization import int8_kernel, quantize_weights

    monkeypatch.setenv("FOVEAL_INT8_KERNEL", kernel)
    int8_kernel.cache_clear()
    torch.manual_seed(1)
    block = SparseMoeBlock(32, 24, 6, 2, "silu")
    for param in block.parameters():
        param.normal_(0, 0.3)
    x = torch.randn(7, 32)
    dense = block(x)
    router = block.gate.weight.clone()
    assert quantize_weights(block, "int8") == 1  # the experts; the router stays float
    int8_kernel.cache_clear()
    assert block.experts.gate_up_proj.numel() == 0 and torch.equal(block.gate.weight, router)
    error = (block(x) - dense).abs().max() / dense.abs().max()
    assert 0 < error < 0.05


def test_int8_engine_agrees_with_float_by_teacher_forcing(setup, monkeypatch):
    """The exact kernel (per-token activations): FBGEMM's one 7-bit scale per call
    moves this tiny random model's near-tied logits more (0.86-0.90 top-1 here)."""
    from foveal.bench.kv_accuracy import agreement, reference_run
    from foveal.layers.quantization import int8_kernel

    monkeypatch.setenv("FOVEAL_INT8_KERNEL", "exact")
    int8_kernel.cache_clear()
    path, _ = setup
    prompts = [{"prompt": f"Tell me about the number {n} and the colour blue."} for n in range(3)]
    kwargs = dict(max_model_len=256, kv_cache_memory_bytes=KV_BYTES)
    reference = reference_run(LLM(model=path, **kwargs), prompts, 48)
    result = agreement(LLM(model=path, quantization="int8", **kwargs), prompts, reference)
    int8_kernel.cache_clear()
    assert result.positions == 144
    assert result.top1_agreement >= 0.9 and result.mean_abs_logit_diff > 0


def test_ngram_speculation_is_lossless_with_images_and_an_int8_kv_cache(setup):
    path, _ = setup
    text = "red blue red blue red blue red blue red"
    outputs = {}
    for name, extra in {"plain": {}, "ngram": {"speculative_config": {
            "method": "ngram", "num_speculative_tokens": 3}}}.items():
        llm = LLM(model=path, max_model_len=512, kv_cache_dtype="int8",
                  kv_cache_memory_bytes=KV_BYTES, **extra)
        chat = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": text}]}]
        prompts = [_prompt(llm, chat, {"image": _image(128, 96, 9)}), {"prompt": text}]
        outputs[name] = [o.outputs[0].token_ids for o in
                         llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert outputs["ngram"] == outputs["plain"]
