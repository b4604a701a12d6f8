"""The Qwen3-VL vision tower.

Patches (16 px, 2 frames) -> linear patch embed (with bias) + a learned
position table bilinearly interpolated to each frame's grid -> LayerNorm
blocks with 2-D RoPE, attention within one frame -> patch merger. DeepStack:
the outputs of `deepstack_visual_indexes` blocks go through their own mergers
(LayerNorm after the 2x2 shuffle); the text decoder adds them to its first
layers. Attention, RoPE and patch order are Qwen2-VL's (qwen_vision).
"""
from __future__ import annotations

import torch
from torch import nn

from foveal.config import VisionConfig
from foveal.layers.activation import get_activation
from foveal.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from foveal.layers.rotary import VisionRotaryEmbedding, vision_position_ids
from foveal.models.qwen_vision import VISION_NORM_EPS, VisionAttention


class Qwen3VisionPatchEmbed(nn.Module):
    """HF's Conv3d (stride == kernel, with bias) as a linear map of each flattened patch."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.proj = ReplicatedLinear(patch_dim, config.hidden_size, bias=True)
        self.proj.weight.hf_shape = (config.hidden_size, config.in_channels, config.temporal_patch_size,
                                     config.patch_size, config.patch_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))  # (N, hidden)


class Qwen3VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, hidden_act: str):
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(dim, hidden_dim, bias=True)
        self.act = get_activation(hidden_act)
        self.linear_fc2 = RowParallelLinear(hidden_dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=VISION_NORM_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=VISION_NORM_EPS)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = Qwen3VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x, cos, sin, segment_lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segment_lengths)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """m^2 neighbouring patches -> one token; the LayerNorm runs on each patch
    (main merger) or on the concatenated m^2 patches (DeepStack mergers)."""

    def __init__(self, config: VisionConfig, norm_after_shuffle: bool):
        super().__init__()
        self.merged_dim = config.hidden_size * config.spatial_merge_size ** 2
        self.norm_after_shuffle = norm_after_shuffle
        self.norm = nn.LayerNorm(self.merged_dim if norm_after_shuffle else config.hidden_size,
                                 eps=VISION_NORM_EPS)
        self.linear_fc1 = ColumnParallelLinear(self.merged_dim, self.merged_dim, bias=True)
        self.act = nn.GELU()
        self.linear_fc2 = RowParallelLinear(self.merged_dim, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_after_shuffle:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)  # (N / m^2, m^2 * hidden)
        return self.linear_fc2(self.act(self.linear_fc1(x)))  # (N / m^2, out_hidden)


def interpolated_positions(grid_thw: list[tuple[int, int, int]], side: int, merge_size: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) taps into a side x side table for every patch,
    in the tower's patch order (merge blocks contiguous, frames repeated).

    Returns indices (N, 4) into the flattened table and weights (N, 4) fp32."""
    indices, weights = [], []
    for t, h, w in grid_thw:
        rows = torch.arange(h, dtype=torch.float32) * (side - 1) / max(h - 1, 1)  # (h,) source rows
        cols = torch.arange(w, dtype=torch.float32) * (side - 1) / max(w - 1, 1)  # (w,)
        r0, c0 = rows.floor().long(), cols.floor().long()
        r1, c1 = (r0 + 1).clamp(max=side - 1), (c0 + 1).clamp(max=side - 1)
        dr, dc = rows - r0, cols - c0
        taps = torch.stack([r0[:, None] * side + c0, r0[:, None] * side + c1,
                            r1[:, None] * side + c0, r1[:, None] * side + c1], dim=-1)  # (h, w, 4)
        tap_weights = torch.stack([(1 - dr)[:, None] * (1 - dc), (1 - dr)[:, None] * dc,
                                   dr[:, None] * (1 - dc), dr[:, None] * dc], dim=-1)  # (h, w, 4)
        order = vision_position_ids([(1, h, w)], merge_size)  # (h*w, 2) (row, col) in tower order
        indices.append(taps[order[:, 0], order[:, 1]].repeat(t, 1))
        weights.append(tap_weights[order[:, 0], order[:, 1]].repeat(t, 1))
    return torch.cat(indices), torch.cat(weights)


class Qwen3VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.merge_size = config.spatial_merge_size
        self.side = int(config.num_position_embeddings ** 0.5)
        self.patch_embed = Qwen3VisionPatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.rotary_pos_emb = VisionRotaryEmbedding(config.hidden_size // config.num_heads)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen3PatchMerger(config, norm_after_shuffle=False)
        self.deepstack_visual_indexes = tuple(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(config, norm_after_shuffle=True) for _ in self.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values (N, C*T*P*P) of the items in grid_thw order
        -> (N / m^2, out_hidden * (1 + K)): the merger's tokens, then each
        DeepStack merger's, side by side."""
        x = self.patch_embed(pixel_values)  # (N, hidden)
        taps, tap_weights = interpolated_positions(grid_thw, self.side, self.merge_size)
        pos = (self.pos_embed(taps.to(x.device)) * tap_weights.to(x.device, x.dtype)[..., None]).sum(1)
        x = x + pos  # (N, hidden)
        cos, sin = self.rotary_pos_emb(vision_position_ids(grid_thw, self.merge_size).to(x.device))
        frame_lengths = [h * w for t, h, w in grid_thw for _ in range(t)]
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_lengths)
            if index in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)
