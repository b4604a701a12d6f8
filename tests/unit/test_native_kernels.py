"""The native decode kernels (foveal/kernels): the float32 / bfloat16 tile kernel from one
to NATIVE_F32_ROWS rows and exact int8 (one to three groups of GROUP_ROWS rows, partial
groups and partial tiles of weight rows included), and the pure-decode paged attention
with its KV write, against torch
on the same inputs; their argument checks; and engines built with and without them
giving the same tokens (images, GQA, sliding windows, int8 weights, preemption)."""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from foveal import LLM, SamplingParams
from foveal.kernels import native
from foveal.kernels.native import GROUP_ROWS, native_kernels
from foveal.layers.linear import NATIVE_F32_ROWS
from foveal.layers.quantization import int8_kernel
from tests.models.test_gemma3_engine import _image, _user


@pytest.fixture(scope="module")
def kernels():
    built = native_kernels()
    assert built is not None, "the native kernels did not build on this x86 machine"
    return built


@contextlib.contextmanager
def native_disabled():
    """FOVEAL_NATIVE_KERNELS=0 for engines built and run inside the block."""
    previous = os.environ.get("FOVEAL_NATIVE_KERNELS")
    os.environ["FOVEAL_NATIVE_KERNELS"] = "0"
    native.native_kernels.cache_clear()
    try:
        yield
    finally:
        if previous is None:
            del os.environ["FOVEAL_NATIVE_KERNELS"]
        else:
            os.environ["FOVEAL_NATIVE_KERNELS"] = previous
        native.native_kernels.cache_clear()


def test_disabled_by_environment():
    with native_disabled():
        assert native_kernels() is None
    assert native_kernels() is not None


ROWS = [*range(1, 2 * GROUP_ROWS + 2), 3 * GROUP_ROWS]  # whole and partial groups


@pytest.mark.parametrize("rows", [*ROWS, 17, NATIVE_F32_ROWS - 1, NATIVE_F32_ROWS])
@pytest.mark.parametrize("in_features", [896, 100, 37, 4864])  # whole vectors, tails, long rows
def test_gemv_matches_linear(kernels, rows, in_features):
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(531, in_features, generator=generator)  # 531: a partial row block
    x = torch.randn(rows, in_features, generator=generator)
    torch.testing.assert_close(kernels.gemv(x, weight), F.linear(x, weight), rtol=1e-5, atol=3e-4)
    bf16 = weight.bfloat16()
    torch.testing.assert_close(kernels.gemv(x, bf16), F.linear(x, bf16.float()), rtol=1e-5,
                               atol=3e-4)


def test_gemv_gives_a_row_the_same_bits_at_any_row_count(kernels):
    """A row's result does not depend on how many rows share the call (its sums run in
    the same order in every group of rows): a decode token gets the same bits at any
    batch size the kernel serves."""
    generator = torch.Generator().manual_seed(7)
    for weight in (torch.randn(531, 896, generator=generator),
                   torch.randn(531, 896, generator=generator).bfloat16()):
        x = torch.randn(NATIVE_F32_ROWS, 896, generator=generator)
        full = kernels.gemv(x, weight)
        for rows in range(1, NATIVE_F32_ROWS):
            assert torch.equal(kernels.gemv(x[-rows:].contiguous(), weight), full[-rows:]), rows


@pytest.mark.parametrize("out_features", [1, 2, 3, 5, 6, 7])
def test_gemv_on_fewer_weight_rows_than_a_tile(kernels, out_features):
    """Weight matrices smaller than one tile (TILE_W rows) and one row block."""
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 64, generator=generator)
    for rows in (1, 5):
        x = torch.randn(rows, 64, generator=generator)
        torch.testing.assert_close(kernels.gemv(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("in_features", [896, 200, 37])
def test_int8_gemv_is_exact(kernels, rows, in_features):
    generator = torch.Generator().manual_seed(rows + in_features)
    weight = torch.randint(-127, 128, (301, in_features), dtype=torch.int8, generator=generator)
    x = torch.randint(-127, 128, (rows, in_features), dtype=torch.int8, generator=generator)
    # extremes too: every product at +-127 * 127, where an offset or a sign slip shows,
    # in the first group of rows (which sums the offset correction) and the last
    weight[0], x[0], x[-1] = 127, -127, 127
    expected = (x.long() @ weight.long().t()).int()
    if kernels.has_int8:
        assert torch.equal(kernels.gemv_int8(x, weight), expected)
    else:  # built without VNNI: a clear error, and int8_matmul keeps torch._int_mm
        with pytest.raises(ValueError, match="VNNI"):
            kernels.gemv_int8(x, weight)


def test_gemv_checks_its_arguments(kernels):
    weight = torch.randn(8, 16)
    with pytest.raises(ValueError, match="at least one row"):
        kernels.gemv(torch.randn(0, 16), weight)
    with pytest.raises(ValueError, match="multiply"):
        kernels.gemv(torch.randn(1, 15), weight)
    with pytest.raises(ValueError, match="dtypes"):
        kernels.gemv(torch.randn(1, 16, dtype=torch.float64), weight)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.gemv(torch.randn(1, 16), torch.randn(16, 8).t())


def _reference_attention(q, slots, tables, lens, block_size, scale, window):
    """SDPA over each request's gathered context: q (B, H, D) -> (B, H, D) float32."""
    batch, heads, head_dim = q.shape
    kv_heads = slots.shape[2]
    outs = []
    for b in range(batch):
        length = int(lens[b])
        positions = torch.arange(max(0, length - window) if window else 0, length)
        flat = tables[b][positions // block_size].long() * block_size + positions % block_size
        keys = slots[0][flat].float().transpose(0, 1)  # (Hkv, L, D)
        values = slots[1][flat].float().transpose(0, 1)
        queries = q[b].float().view(kv_heads, heads // kv_heads, head_dim)
        outs.append(F.scaled_dot_product_attention(queries, keys, values, scale=scale)
                    .reshape(heads, head_dim))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,window,length", [
    (1, 14, 2, 64, None, None),  # GQA, one request (a batch-1 decode step)
    (3, 8, 8, 64, None, None),  # MHA, several requests
    (2, 16, 4, 128, 5, None),  # a sliding-window layer
    (4, 6, 2, 40, None, None),  # a head size that is not a whole number of vectors
    (2, 4, 2, 64, None, 1),  # contexts of one position
])
def test_decode_attention_matches_sdpa(kernels, dtype, batch, heads, kv_heads, head_dim, window,
                                       length):
    """Random context lengths (or `length`) over blocks scattered through the pool."""
    generator = torch.Generator().manual_seed(batch * 100 + heads + head_dim)
    block_size, num_blocks, per_request = 16, 64, 13
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    slots = cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    lens = (torch.full((batch,), length, dtype=torch.int32) if length else
            torch.randint(1, per_request * block_size, (batch,), dtype=torch.int32,
                          generator=generator))
    order = torch.randperm(num_blocks, generator=generator)  # blocks scattered over the pool
    tables = order[:batch * per_request].view(batch, per_request).to(torch.int32)
    last = lens.long() - 1
    slot_mapping = tables[torch.arange(batch), last // block_size].long() * block_size + last % block_size
    q = torch.randn(batch, heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(batch, kv_heads, head_dim, generator=generator).to(dtype)
    expected_cache = slots.clone()
    expected_cache[0][slot_mapping], expected_cache[1][slot_mapping] = k, v
    scale = head_dim ** -0.5
    expected = _reference_attention(q, expected_cache, tables, lens, block_size, scale, window)

    out = kernels.decode_attention(q, k, v, slots, slot_mapping, tables, block_size, lens,
                                   scale, window)
    assert torch.equal(slots, expected_cache)  # the new K/V written, nothing else touched
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_decode_attention_checks_its_arguments(kernels):
    slots = torch.zeros(2, 64, 2, 8)
    q, k = torch.zeros(1, 4, 8), torch.zeros(1, 2, 8)
    tables, lens, slot = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), \
        torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="dtype"):
        kernels.decode_attention(q.double(), k, k, slots, slot, tables, 16, lens, 1.0, None)
    with pytest.raises(ValueError, match="shapes"):
        kernels.decode_attention(torch.zeros(1, 3, 8), k, k, slots, slot, tables, 16, lens, 1.0,
                                 None)


CONVERSATIONS = [
    _user("Describe this picture in detail.", [_image(84, 56, 1)]),
    _user("Hello there, how are you today?"),
    _user("Which of the two is brighter?", [_image(56, 84, 2), _image(56, 56, 3)]),
    _user("Describe this picture in detail.", [_image(84, 56, 1)]),  # a prefix-cache hit
]


def _generate(path: str, repeat: int = 1, **options) -> list[tuple[list[int], list[float]]]:
    options = {"max_model_len": 1024, "max_num_batched_tokens": 48, "max_num_seqs": 8,
               "kv_cache_memory_bytes": 8 << 20, "block_size": 4, **options}
    llm = LLM(model=path, **options)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = llm.chat(CONVERSATIONS * repeat, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [entry[token].logprob for entry, token in zip(o.outputs[0].logprobs,
                                                           o.outputs[0].token_ids)])
            for o in outputs]


@pytest.mark.parametrize("preset,options", [
    ("tiny-qwen2-vl", {}),
    ("tiny-qwen2-vl", {"quantization": "int8"}),  # decode steps on the exact int8 GEMV
    # 12 requests: decode steps of 5-12 rows, several row groups per int8 GEMV
    ("tiny-qwen2-vl", {"quantization": "int8", "repeat": 3, "max_num_seqs": 12,
                       "max_num_batched_tokens": 256}),
    ("tiny-qwen2-vl", {"dtype": "bfloat16"}),
    ("tiny-qwen2-vl", {"kv_cache_memory_bytes": 40 * 2048, "max_model_len": 160}),  # preemption
    ("tiny-gemma3", {}),  # sliding-window layers and bidirectional image spans
], ids=["fp32", "int8-weights", "int8-weights-12-requests", "bf16", "preemption", "gemma3"])
def test_engine_with_native_kernels_matches_without(tiny_checkpoints, monkeypatch, preset,
                                                   options):
    """Decode steps on the native attention (and int8 GEMV) give the tokens of the
    engine that runs torch's ops, with logprobs equal up to summation order."""
    calls = {"decode_attention": 0, "gemv_int8": 0, "gemv": 0}
    int8_rows = []
    for name in calls:
        def counted(self, *args, _name=name, _method=getattr(native.NativeKernels, name), **kwargs):
            calls[_name] += 1
            if _name == "gemv_int8":
                int8_rows.append(args[0].shape[0])
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(native.NativeKernels, name, counted)
    path = tiny_checkpoints(preset)
    with native_disabled():
        expected = _generate(path, **options)
    assert calls == {"decode_attention": 0, "gemv_int8": 0, "gemv": 0}
    got = _generate(path, **options)
    assert calls["decode_attention"] > 0  # every decode step of every layer
    if options.get("dtype") != "bfloat16" and "quantization" not in options:
        assert calls["gemv"] > 0  # fp32 decode steps on the tile kernel
    if options.get("quantization") == "int8" and int8_kernel() == "exact" and native_kernels().has_int8:
        assert calls["gemv_int8"] > 0  # decode rows of every int8 layer
        if options.get("repeat", 1) > 1:  # batches above one row group ran on it too
            assert max(int8_rows) > native.GROUP_ROWS
    tolerance = 2e-4 if options.get("dtype") != "bfloat16" else 5e-2
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=tolerance)


def test_speculative_verify_steps_run_the_tile_kernel_and_keep_the_tokens(tiny_checkpoints,
                                                                         monkeypatch):
    """n-gram speculation: verify steps (each request's last token and its drafts, all
    generated rows) run the fp32 tile kernel as decode steps do, and the greedy tokens
    equal decoding without speculation."""
    from tests.e2e.test_speculative_decoding import GREEDY, NGRAM, conversations

    rows = []
    gemv = native.NativeKernels.gemv
    monkeypatch.setattr(native.NativeKernels, "gemv",
                        lambda self, x, w: rows.append(x.shape[0]) or gemv(self, x, w))
    path = tiny_checkpoints("tiny-qwen2-vl")
    options = dict(max_model_len=512, kv_cache_memory_bytes=1 << 21, max_num_batched_tokens=256)
    plain = LLM(model=path, **options).chat(conversations(), GREEDY, use_tqdm=False)
    rows.clear()
    speculative = LLM(model=path, speculative_config=NGRAM, **options)
    outputs = speculative.chat(conversations(), GREEDY, use_tqdm=False)
    assert speculative.get_metrics()["foveal:spec_decode_num_draft_tokens_total"] > 0
    # more rows than requests: a verify step's drafts ran on the tile kernel
    assert max(rows) > len(conversations())
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
