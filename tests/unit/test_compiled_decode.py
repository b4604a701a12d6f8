"""`--compile-decode`: steps of at most 4 tokens through one Inductor graph give
the eager engine's greedy tokens and logprobs, on every decoder family, beside the
features that change what a step holds (images, chunked prefill, prefix and encoder
caching, preemption, n-gram drafts, int8 weights, quantized KV)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from foveal import LLM, SamplingParams
from foveal.config import EngineConfig, ModelConfig
from foveal.worker.compiled_decode import MAX_ROWS, CompiledDecode, compile_applies
from tests.models.test_gemma3_engine import _image, _user

MAX_TOKENS = 6

CONVERSATIONS = [
    _user("Describe this picture in detail.", [_image(84, 56, 1)]),
    _user("Hello there, how are you today?"),
    _user("Which of the two is brighter?", [_image(56, 84, 2), _image(56, 56, 3)]),
    _user("Write a short poem about the sea."),
    _user("Describe this picture in detail.", [_image(84, 56, 1)]),  # a cache hit
]


def _run(llm: LLM, conversations=CONVERSATIONS, **sampling) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1,
                            **sampling)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [entry[token].logprob for entry, token in zip(o.outputs[0].logprobs,
                                                           o.outputs[0].token_ids)])
            for o in outputs]


def _compiled_steps(llm: LLM) -> int:
    compiled = llm.llm_engine.core.executor.model_runner.compiled_decode
    assert compiled is not None, "decode steps were not compiled"
    return compiled.steps


def _assert_same(got, expected) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=2e-4)


def _engines(path: str, **options) -> tuple[LLM, LLM]:
    options = {"max_model_len": 1024, "max_num_batched_tokens": 48, "max_num_seqs": 8,
               "kv_cache_memory_bytes": 8 << 20, "block_size": 4, **options}
    return LLM(model=path, **options), LLM(model=path, compile_decode=True, **options)


@pytest.mark.parametrize("preset", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl",
                                    "tiny-gemma3", "tiny-llava-next", "tiny-idefics3"])
def test_compiled_decode_matches_eager_on_every_family(tiny_checkpoints, preset):
    """A mixed batch (images, multi-image, text, a repeated image) with 48-token
    steps: the prompts are chunked, the decode steps of 5 requests run eagerly
    and those of 1-4 through the graph."""
    eager, compiled = _engines(tiny_checkpoints(preset))
    expected = _run(eager)
    _assert_same(_run(compiled), expected)
    assert _compiled_steps(compiled) > 0
    # one request alone: every decode step is the 1-token graph (and so is the prompt's
    # recomputed last block after its prefix-cache hit, when that holds at most 4 tokens)
    before = _compiled_steps(compiled)
    _assert_same(_run(compiled, CONVERSATIONS[:1]), expected[:1])
    assert _compiled_steps(compiled) - before >= MAX_TOKENS - 1


@pytest.mark.parametrize("options", [
    {"quantization": "int8"},  # linear layers through the foveal::linear op
    {"kv_cache_dtype": "int8"},  # the quantized-cache attention path behind the op
    {"kv_cache_memory_bytes": 40 * 2048, "max_model_len": 160},  # 40 blocks: preemption
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
], ids=["int8-weights", "int8-kv", "preemption", "ngram"])
def test_compiled_decode_with_engine_features(tiny_checkpoints, options):
    eager, compiled = _engines(tiny_checkpoints("tiny-qwen2-vl"), **options)
    _assert_same(_run(compiled), _run(eager))
    assert _compiled_steps(compiled) > 0
    if "kv_cache_memory_bytes" in options:
        assert compiled.llm_engine.core.get_stats()["foveal:num_preemptions_total"] > 0


def test_a_bfloat16_engine_compiles_too(tiny_checkpoints):
    eager, compiled = _engines(tiny_checkpoints("tiny-qwen2-vl"), dtype="bfloat16")
    expected, got = _run(eager, CONVERSATIONS[:2]), _run(compiled, CONVERSATIONS[:2])
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert _compiled_steps(compiled) > 0


def test_where_decode_steps_are_not_compiled(tiny_checkpoints):
    from foveal.engine_args import EngineArgs

    path = tiny_checkpoints("tiny-qwen2-vl")

    def config(**options) -> EngineConfig:
        return EngineArgs(model=path, compile_decode=True, **options).create_engine_config()

    assert compile_applies(config(), has_draft_head=False) is None
    assert "EAGLE" in compile_applies(config(), has_draft_head=True)
    assert "tensor parallelism" in compile_applies(config(tensor_parallel_size=2), False)
    moe = config()
    moe = EngineConfig(**{**moe.__dict__, "model": ModelConfig(**{
        **moe.model.__dict__, "text": type(moe.model.text)(**{**moe.model.text.__dict__,
                                                              "num_experts": 8})})})
    assert "MoE" in compile_applies(moe, False)


def test_more_rows_than_the_graph_takes_run_eagerly():
    class Model(torch.nn.Module):
        def forward(self, inputs_embeds, positions):
            return inputs_embeds * 2

        def compute_logits(self, hidden_states):
            return hidden_states.sum(-1, keepdim=True)

    compiled = CompiledDecode(Model(), hidden_size=8, dtype=torch.float32, num_axes=1)
    rows = torch.ones(MAX_ROWS + 1, 8)
    assert compiled.run(rows, torch.arange(MAX_ROWS + 1)) is None
    assert torch.equal(compiled.run(rows[:3], torch.arange(3)), rows[:3] * 2)
    assert compiled.steps == 1
    assert torch.equal(compiled.compute_logits(rows), rows.sum(-1, keepdim=True))  # eager
    assert torch.equal(compiled.compute_logits(rows[:2]), rows[:2].sum(-1, keepdim=True))


def test_the_small_batch_reduction_is_a_linear_layer():
    from foveal.layers.linear import small_batch_linear

    torch.manual_seed(0)
    x, weight, bias = torch.randn(3, 40), torch.randn(24, 40), torch.randn(24)
    torch.testing.assert_close(small_batch_linear(x, weight, bias), F.linear(x, weight, bias))
    half = small_batch_linear(x.bfloat16(), weight.bfloat16())
    assert half.dtype == torch.bfloat16 and half.shape == (3, 24)
    torch.testing.assert_close(half.float(), F.linear(x.bfloat16().float(), weight.bfloat16().float()),
                               atol=0.05, rtol=0.02)


def test_a_model_that_does_not_compile_runs_eagerly():
    class HostBranch(torch.nn.Module):
        def forward(self, inputs_embeds, positions):
            if inputs_embeds.sum().item() > 0:  # a host-side branch: no full graph
                return inputs_embeds
            return -inputs_embeds

        def compute_logits(self, hidden_states):
            return hidden_states

    compiled = CompiledDecode(HostBranch(), hidden_size=8, dtype=torch.float32, num_axes=1)
    why_not = compiled.warm_up([])
    assert why_not is not None and why_not.split(":")[0].endswith(("Unsupported", "Error"))
