"""The Qwen2-VL / Qwen2.5-VL vision tower.

Patches -> linear patch embed -> blocks with 2-D RoPE -> patch merger
(spatial_merge_size^2 neighbouring patches -> one visual token). Attention
stays within one image (or one video frame); Qwen2.5-VL blocks outside
`fullatt_block_indexes` attend within windows of window_size pixels. The two
variants differ in norm and MLP only: entries of `VISION_VARIANTS`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from foveal.config import VisionConfig
from foveal.errors import ConfigError
from foveal.layers.activation import get_activation
from foveal.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from foveal.layers.norm import RMSNorm
from foveal.layers.rotary import VisionRotaryEmbedding, apply_rotary, vision_position_ids
from foveal.models.qwen2 import Qwen2MLP

VISION_NORM_EPS = 1e-6


class VisionPatchEmbed(nn.Module):
    """HF's Conv3d with stride == kernel is a linear map of each flattened patch."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.proj = ReplicatedLinear(patch_dim, config.hidden_size, bias=False)
        self.proj.weight.hf_shape = (config.hidden_size, config.in_channels, config.temporal_patch_size,
                                     config.patch_size, config.patch_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))  # (N, hidden)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      segment_lengths: list[int], scale: float) -> torch.Tensor:
    """Bidirectional attention within consecutive segments. q/k/v (N, H, D) -> (N, H, D).

    Segments of equal length (most windows, repeated video frames) share one
    batched SDPA call."""
    out = torch.empty_like(q)
    starts = [0]
    for length in segment_lengths:
        starts.append(starts[-1] + length)
    by_length: dict[int, list[int]] = {}
    for start, length in zip(starts, segment_lengths):
        by_length.setdefault(length, []).append(start)
    for length, group_starts in by_length.items():
        rows = (torch.tensor(group_starts).unsqueeze(-1) + torch.arange(length)).to(q.device)  # (S, L)
        qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))  # (S, H, L, D)
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2)
    return out


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = ReplicatedLinear(dim, 3 * dim, bias=True)
        self.proj = ReplicatedLinear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segment_lengths: list[int]) -> torch.Tensor:
        num_patches = x.shape[0]
        qkv = self.qkv(x).view(num_patches, 3, self.num_heads, self.head_dim)  # (N, 3, H, D)
        q, k, v = qkv.unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = segment_attention(q, k, v, segment_lengths, self.head_dim ** -0.5)  # (N, H, D)
        return self.proj(out.reshape(num_patches, -1))


class VisionFcMLP(nn.Module):
    """Qwen2-VL: fc1 -> act -> fc2."""

    def __init__(self, dim: int, hidden_dim: int, hidden_act: str):
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, hidden_dim, bias=True)
        self.act = get_activation(hidden_act)
        self.fc2 = RowParallelLinear(hidden_dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@dataclass(frozen=True)
class VisionVariant:
    make_norm: Callable[[int], nn.Module]
    make_mlp: Callable[[VisionConfig], nn.Module]


VISION_VARIANTS: dict[str, VisionVariant] = {
    "qwen2_vl": VisionVariant(
        make_norm=lambda dim: nn.LayerNorm(dim, eps=VISION_NORM_EPS),
        make_mlp=lambda c: VisionFcMLP(c.hidden_size, c.intermediate_size, c.hidden_act)),
    "qwen2_5_vl": VisionVariant(
        make_norm=lambda dim: RMSNorm(dim, eps=VISION_NORM_EPS),
        make_mlp=lambda c: Qwen2MLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=True)),
}


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, variant: VisionVariant):
        super().__init__()
        self.norm1 = variant.make_norm(config.hidden_size)
        self.norm2 = variant.make_norm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = variant.make_mlp(config)

    def forward(self, x, cos, sin, segment_lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segment_lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig, variant: VisionVariant):
        super().__init__()
        self.merged_dim = config.hidden_size * config.spatial_merge_size ** 2
        self.ln_q = variant.make_norm(config.hidden_size)
        self.mlp = nn.Sequential(ColumnParallelLinear(self.merged_dim, self.merged_dim, bias=True),
                                 nn.GELU(),
                                 RowParallelLinear(self.merged_dim, config.out_hidden_size, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))  # (N / m^2, out_hidden)


def window_order(grid_thw: list[tuple[int, int, int]], merge_size: int,
                 window_merged: int) -> tuple[torch.Tensor, list[int]]:
    """Reorder merged tokens window by window (each frame split into
    window_merged x window_merged squares of merged tokens, row-major).

    Returns (order, window_lengths): order (N/m^2,) indexes the merged tokens in
    patch order; window_lengths are in patches, one per non-empty window."""
    orders, lengths, base = [], [], 0
    for t, h, w in grid_thw:
        rows, cols = h // merge_size, w // merge_size
        pad_rows, pad_cols = -rows % window_merged, -cols % window_merged
        index = torch.arange(t * rows * cols).view(t, rows, cols) + base
        index = F.pad(index, (0, pad_cols, 0, pad_rows), value=-1)  # (t, R, C) padded
        index = index.view(t, (rows + pad_rows) // window_merged, window_merged,
                           (cols + pad_cols) // window_merged, window_merged)
        index = index.permute(0, 1, 3, 2, 4).reshape(-1, window_merged * window_merged)  # (windows, w*w)
        counts = (index >= 0).sum(-1)
        orders.append(index[index >= 0])
        lengths += [int(c) * merge_size ** 2 for c in counts if c > 0]
        base += t * rows * cols
    return torch.cat(orders), lengths


class VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        if config.variant not in VISION_VARIANTS:
            raise ConfigError(f"vision variant {config.variant!r} is unknown; supported: "
                              f"{sorted(VISION_VARIANTS)}")
        variant = VISION_VARIANTS[config.variant]
        self.merge_size = config.spatial_merge_size
        self.fullatt_block_indexes = set(config.fullatt_block_indexes)
        self.window_merged = config.window_size // config.spatial_merge_size // config.patch_size
        self.patch_embed = VisionPatchEmbed(config)
        self.rotary_pos_emb = VisionRotaryEmbedding(config.hidden_size // config.num_heads)
        self.blocks = nn.ModuleList(VisionBlock(config, variant) for _ in range(config.depth))
        self.merger = PatchMerger(config, variant)

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values (N, C*T*P*P) of the items in grid_thw order -> (N / m^2, out_hidden)."""
        x = self.patch_embed(pixel_values)  # (N, hidden)
        cos, sin = self.rotary_pos_emb(vision_position_ids(grid_thw, self.merge_size).to(x.device))
        frame_lengths = [h * w for t, h, w in grid_thw for _ in range(t)]
        window_lengths, merged_order = frame_lengths, None
        if self.window_merged > 0:
            merged_order, window_lengths = window_order(grid_thw, self.merge_size, self.window_merged)
            unit = self.merge_size ** 2
            patch_order = (merged_order.unsqueeze(-1) * unit + torch.arange(unit)).flatten().to(x.device)
            x, cos, sin = x[patch_order], cos[patch_order], sin[patch_order]
        for index, block in enumerate(self.blocks):
            full = merged_order is None or index in self.fullatt_block_indexes
            x = block(x, cos, sin, frame_lengths if full else window_lengths)
        merged = self.merger(x)  # (N / m^2, out_hidden), in window order
        if merged_order is not None:
            merged = merged[torch.argsort(merged_order).to(merged.device)]
        return merged
