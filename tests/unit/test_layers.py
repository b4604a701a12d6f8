"""Layers: tensor-parallel sharding, norms, activations, rotary, vision ordering."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import foveal.layers.embed_head as embed_head
import foveal.layers.linear as linear
from foveal.errors import CheckpointError, ConfigError
from foveal.layers.activation import ActAndMul, get_activation
from foveal.layers.norm import RMSNorm
from foveal.layers.rotary import MRotaryEmbedding, VisionRotaryEmbedding, vision_position_ids
from foveal.models.qwen_vision import segment_attention, window_order


def as_rank(monkeypatch, module, rank: int, size: int) -> None:
    monkeypatch.setattr(module, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(module, "get_tp_size", lambda: size)


def sharded(monkeypatch, make, tp_size: int, module=linear):
    layers = []
    for rank in range(tp_size):
        as_rank(monkeypatch, module, rank, tp_size)
        layers.append(make())
    return layers


def test_column_then_row_parallel_shards_sum_to_the_full_mlp(monkeypatch):
    w1, b1, w2, b2 = torch.randn(8, 6), torch.randn(8), torch.randn(6, 8), torch.randn(6)
    x = torch.randn(3, 6)
    expected = F.linear(F.linear(x, w1, b1).relu(), w2, b2)
    total = 0
    columns = sharded(monkeypatch, lambda: linear.ColumnParallelLinear(6, 8, bias=True), 2)
    rows = sharded(monkeypatch, lambda: linear.RowParallelLinear(8, 6, bias=False), 2)
    for column, row in zip(columns, rows):
        column.weight.weight_loader(column.weight, w1)
        column.bias.weight_loader(column.bias, b1)
        row.weight.weight_loader(row.weight, w2)
        total = total + row(column(x).relu())
    torch.testing.assert_close(total + b2, expected)


def test_qkv_linear_places_q_k_v_and_replicates_scarce_kv_heads(monkeypatch):
    head_dim, hidden = 2, 4
    q, k, v = torch.randn(4 * head_dim, hidden), torch.randn(1 * head_dim, hidden), torch.randn(head_dim, hidden)
    layers = sharded(monkeypatch, lambda: linear.QKVParallelLinear(hidden, head_dim, 4, 1), 2)
    for rank, layer in enumerate(layers):
        for shard_id, weight in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, weight, shard_id)
        expected = torch.cat([q[rank * 4:(rank + 1) * 4], k, v])
        assert torch.equal(layer.weight, expected)


def test_merged_column_linear_loads_parts_by_shard_id():
    layer = linear.MergedColumnParallelLinear(3, [2, 4])
    gate, up = torch.randn(2, 3), torch.randn(4, 3)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    assert torch.equal(layer.weight, torch.cat([gate, up]))
    with pytest.raises(CheckpointError, match="shard id"):
        layer.weight.weight_loader(layer.weight, gate)


def test_weight_of_wrong_shape_is_a_checkpoint_error():
    layer = linear.ReplicatedLinear(3, 2)
    with pytest.raises(CheckpointError, match=r"\(2, 3\)"):
        layer.weight.weight_loader(layer.weight, torch.randn(3, 3))


def test_heads_not_divisible_by_tp_size_is_a_config_error(monkeypatch):
    as_rank(monkeypatch, linear, 0, 3)
    with pytest.raises(ConfigError, match="tensor_parallel_size=3"):
        linear.QKVParallelLinear(8, 2, 4, 2)


def test_vocab_parallel_embedding_shards_rows_and_masks_foreign_ids(monkeypatch):
    table = torch.randn(10, 4)
    ids = torch.tensor([0, 4, 5, 9])
    total = 0
    for layer in sharded(monkeypatch, lambda: embed_head.VocabParallelEmbedding(10, 4), 2, embed_head):
        layer.weight.weight_loader(layer.weight, table)
        total = total + layer(ids)
    torch.testing.assert_close(total, table[ids])


def test_tied_lm_head_shares_the_embedding_weight():
    embedding = embed_head.VocabParallelEmbedding(10, 4)
    embedding.weight.data.normal_()
    head = embed_head.ParallelLMHead(10, 4, tied_embedding=embedding)
    hidden = torch.randn(2, 4)
    assert head.weight is embedding.weight
    torch.testing.assert_close(head(hidden), hidden @ embedding.weight.T)


def test_rms_norm_with_residual_equals_add_then_norm():
    norm = RMSNorm(8, eps=1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    out, new_residual = norm(x, residual)
    summed = x + residual
    expected = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(new_residual, summed)


def test_activation_registry_and_unknown_name():
    x = torch.randn(5)
    torch.testing.assert_close(get_activation("quick_gelu")(x), x * torch.sigmoid(1.702 * x))
    torch.testing.assert_close(ActAndMul("silu")(torch.cat([x, 2 * x])), F.silu(x) * 2 * x)
    with pytest.raises(ConfigError, match="quick_gelu"):
        get_activation("mish2")


def test_mrope_with_equal_axes_is_standard_rope():
    rope = MRotaryEmbedding(head_dim=16, theta=10000.0, mrope_section=(2, 3, 3))
    positions = torch.tensor([0, 3, 7, 100])
    q, k = torch.randn(4, 2 * 16), torch.randn(4, 16)
    q1, k1 = rope(positions, q, k)
    q3, k3 = rope(positions.expand(3, -1), q, k)
    torch.testing.assert_close(q1, q3)
    torch.testing.assert_close(k1, k3)
    torch.testing.assert_close(q1[0], q[0])  # position 0 is the identity
    torch.testing.assert_close(q1.view(4, 2, 16).norm(dim=-1), q.view(4, 2, 16).norm(dim=-1))


def test_mrope_sections_follow_their_axis():
    rope = MRotaryEmbedding(head_dim=16, theta=10000.0, mrope_section=(2, 3, 3))
    positions = torch.tensor([[5], [0], [0]])
    cos, _ = rope.cos_sin(positions)
    assert torch.all(cos[0, 2:8] == 1) and torch.all(cos[0, 10:16] == 1)
    assert not torch.any(cos[0, :2] == 1)


def test_vision_position_ids_are_block_major():
    ids = vision_position_ids([(1, 2, 4)], merge_size=2)
    expected = [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    assert ids.tolist() == expected
    assert vision_position_ids([(2, 2, 2)], 2).shape == (8, 2)


def test_vision_rotary_splits_rows_and_columns():
    cos, sin = VisionRotaryEmbedding(head_dim=8)(torch.tensor([[3, 0]]))
    assert torch.all(cos[0, 2:4] == 1) and torch.all(sin[0, 6:8] == 0)


def test_window_order_groups_merged_tokens_by_window():
    order, lengths = window_order([(1, 6, 6)], merge_size=2, window_merged=2)
    # 3x3 merged tokens; windows: 2x2, 2x1, 1x2, 1x1
    assert order.tolist() == [0, 1, 3, 4, 2, 5, 6, 7, 8]
    assert lengths == [16, 8, 8, 4]


def test_segment_attention_keeps_segments_apart():
    q, k, v = torch.randn(7, 2, 4), torch.randn(7, 2, 4), torch.randn(7, 2, 4)
    out = segment_attention(q, k, v, [3, 4], scale=0.5)
    for start, end in ((0, 3), (3, 7)):
        expected = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
                                                  v[start:end].transpose(0, 1), scale=0.5).transpose(0, 1)
        torch.testing.assert_close(out[start:end], expected)


@pytest.mark.parametrize("native_bf16", [False, True])
def test_prepacked_linear_layers_match_f_linear_in_their_dtype(monkeypatch, native_bf16):
    """fp32 layers always get a oneDNN weight (their dense one where the native kernels
    are built, a blocked copy elsewhere); bf16 ones only on CPUs with bf16 instructions
    (elsewhere the blocked bf16 GEMM is emulated, and slow)."""
    from foveal import cpu_features
    from foveal.layers.linear import ReplicatedLinear, prepack_weights

    flags = frozenset({"avx2", "avx512f", "avx512_bf16"} if native_bf16 else {"avx2"})
    monkeypatch.setattr(cpu_features, "cpu_features",
                        lambda: cpu_features.CPUFeatures("test CPU", flags, "AVX2"))
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"fp32": ReplicatedLinear(32, 48, bias=True),
                                 "bf16": ReplicatedLinear(32, 48, bias=True).to(torch.bfloat16)})
    for layer in model.values():
        torch.nn.init.normal_(layer.weight)
        torch.nn.init.normal_(layer.bias)
    expected = {name: torch.nn.functional.linear(torch.ones(3, 32, dtype=layer.weight.dtype),
                                                 layer.weight, layer.bias)
                for name, layer in model.items()}
    # a CPU that reports bf16 gets blocked bf16 weights where oneDNN can build them (this
    # test fakes the flags: on a real AVX2-only CPU oneDNN cannot, and nothing is packed)
    packs_bf16 = native_bf16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert prepack_weights(model) == (2 if packs_bf16 else 1)
    assert (model["bf16"].packed_weight is not None) == packs_bf16
    for name, layer in model.items():
        out = layer(torch.ones(3, 32, dtype=expected[name].dtype))
        torch.testing.assert_close(out, expected[name], rtol=2e-2, atol=2e-2)


def test_fp32_lm_head_runs_onednn_on_its_dense_weight_without_a_copy():
    """The LM head keeps its dense weight (tied embeddings share it), so an fp32 head's
    oneDNN weight is that tensor, not a second blocked copy; logits equal F.linear's."""
    from foveal.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
    from foveal.layers.linear import prepack_weights

    torch.manual_seed(0)
    embedding = VocabParallelEmbedding(100, 32)
    torch.nn.init.normal_(embedding.weight)
    model = torch.nn.ModuleDict({"embed": embedding,
                                 "head": ParallelLMHead(100, 32, tied_embedding=embedding)})
    hidden = torch.randn(3, 32)
    expected = torch.nn.functional.linear(hidden, embedding.weight)
    assert prepack_weights(model) == 1  # the head; embeddings are not linear layers
    head = model["head"]
    assert head.packed_weight.data_ptr() == embedding.weight.data_ptr()  # no copy
    torch.testing.assert_close(head(hidden), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_fp32_layers_keep_their_dense_weight_and_run_generated_rows_on_the_native_kernel(
        monkeypatch, bias):
    """Where the native kernels are built, an fp32 layer keeps its dense weight (no blocked
    copy): steps of up to NATIVE_F32_ROWS rows that are all generated tokens or drafts run
    the native tile kernel on it; larger steps, steps with prompt rows and calls outside a
    step (the vision tower) run oneDNN on the same tensor. All equal F.linear, 2-D and 3-D."""
    from foveal.forward_context import forward_context
    from foveal.kernels.native import NativeKernels, native_kernels
    from foveal.layers.linear import NATIVE_F32_ROWS, ReplicatedLinear, prepack_weights

    assert native_kernels() is not None, "the native kernels did not build on this x86 machine"
    calls = []
    gemv = NativeKernels.gemv
    monkeypatch.setattr(NativeKernels, "gemv",
                        lambda self, x, w: calls.append(x.shape[0]) or gemv(self, x, w))
    torch.manual_seed(0)
    layer = ReplicatedLinear(96, 40, bias=bias)
    torch.nn.init.normal_(layer.weight)
    if bias:
        torch.nn.init.normal_(layer.bias)
    dense = layer.weight.data_ptr()
    assert prepack_weights(layer) == 1
    assert layer.packed_weight.data_ptr() == dense and layer.native_rows == NATIVE_F32_ROWS
    for step in ("generated", "prompt", "none"):
        for shape in [(1, 96), (7, 96), (NATIVE_F32_ROWS, 96), (2, 5, 96), (NATIVE_F32_ROWS + 1, 96),
                      (300, 96)]:
            x = torch.randn(shape)
            calls.clear()
            if step == "none":
                out = layer(x)
            else:
                with forward_context(None, [], generated_rows=step == "generated"):
                    out = layer(x)
            torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias),
                                       rtol=1e-5, atol=1e-4)
            rows = x.numel() // 96
            assert calls == ([rows] if step == "generated" and rows <= NATIVE_F32_ROWS else []), (step, shape)


def test_linear_layout_dense_keeps_dense_weights_and_rejects_unknown_names(monkeypatch):
    """FOVEAL_LINEAR_LAYOUT=dense: no layer is packed and forward() is F.linear on the
    dense weight; packed packs it; an unknown layout is a ConfigError, not a silent
    default."""
    from foveal.errors import ConfigError
    from foveal.layers.linear import ReplicatedLinear, prepack_weights

    torch.manual_seed(0)
    layer = ReplicatedLinear(32, 48, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 32)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    monkeypatch.setenv("FOVEAL_LINEAR_LAYOUT", "dense")
    assert prepack_weights(layer) == 0
    assert layer.packed_weight is None
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    monkeypatch.setenv("FOVEAL_LINEAR_LAYOUT", "packed")
    assert prepack_weights(layer) == 1
    monkeypatch.setenv("FOVEAL_LINEAR_LAYOUT", "blocked")
    with pytest.raises(ConfigError, match="FOVEAL_LINEAR_LAYOUT"):
        prepack_weights(layer)


def test_the_linear_layout_is_described_as_prepack_weights_applies_it(monkeypatch):
    """The start-up log and `foveal env` say what fp32 layers run on: the native tile
    kernel where it is built, dense F.linear with FOVEAL_LINEAR_LAYOUT=dense."""
    from foveal.kernels.native import native_kernels
    from foveal.layers.linear import NATIVE_F32_ROWS, describe_linear_layout

    assert native_kernels() is not None, "the native kernels did not build on this x86 machine"
    assert f"up to {NATIVE_F32_ROWS} rows on the native tile kernel" in describe_linear_layout()
    monkeypatch.setenv("FOVEAL_LINEAR_LAYOUT", "dense")
    assert describe_linear_layout().startswith("dense")
