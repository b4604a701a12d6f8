"""Rotary position embeddings: standard RoPE, M-RoPE and the vision 2-D RoPE.

All use the "rotate half" layout: dims [0, D/2) pair with [D/2, D).
cos/sin are computed in fp32 and the rotation is applied in fp32.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from foveal.config import RopeScaling


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """(rotary_dim/2,) fp32 inverse frequencies."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    return 1.0 / (theta ** exponents)


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling | None) -> torch.Tensor:
    """inv_freq after the checkpoint's RoPE scaling (same shape, fp32)."""
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: stretch long wavelengths, keep short ones, interpolate the band between
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    long_wavelen = original / scaling.low_freq_factor
    short_wavelen = original / scaling.high_freq_factor
    stretched = torch.where(wavelen > long_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * stretched / scaling.factor + smooth * stretched
    in_band = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(in_band, blended, stretched)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, H, D); cos/sin (N, D) -> rotated x, same dtype as x."""
    x32 = x.float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (N, 1, D)
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


class MRotaryEmbedding(nn.Module):
    """Multimodal RoPE: the D/2 frequencies are split into sections
    (mrope_section, e.g. [16, 24, 24]) driven by the temporal, height and width
    position ids in turn. With 1-D positions (T,) this is standard RoPE."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...] = (),
                 scaling: RopeScaling | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.mrope_section = list(mrope_section) or [head_dim // 2]
        self.register_buffer("inv_freq", scaled_inv_freq(rope_inv_freq(head_dim, theta), scaling),
                             persistent=False)
        # (D/2,) which position axis drives each frequency: 0,0,..,1,1,..,2,2
        axis = [i % 3 for i, size in enumerate(self.mrope_section) for _ in range(size)]
        self.register_buffer("freq_axis", torch.tensor(axis, dtype=torch.long), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (3, T) or (T,) -> cos, sin (T, D) fp32."""
        if positions.dim() == 1:
            freqs = positions.float().unsqueeze(-1) * self.inv_freq  # (T, D/2)
        else:
            axis_positions = positions.float()[self.freq_axis.clamp(max=positions.shape[0] - 1)]
            freqs = axis_positions.transpose(0, 1) * self.inv_freq  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        return emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q (T, H*D), k (T, Hkv*D) -> rotated q, k (same shapes)."""
        return self.rotate(q, k, *self.cos_sin(positions))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotate with cos/sin from cos_sin() (computed once per forward, shared by layers)."""
        num_tokens = q.shape[0]
        q = apply_rotary(q.view(num_tokens, -1, self.head_dim), cos, sin)
        k = apply_rotary(k.view(num_tokens, -1, self.head_dim), cos, sin)
        return q.view(num_tokens, -1), k.view(num_tokens, -1)


def vision_position_ids(grid_thw: list[tuple[int, int, int]], merge_size: int) -> torch.Tensor:
    """(sum t*h*w, 2) (row, col) of every patch, in the vision tower's patch
    order: merge_size x merge_size blocks contiguous, frames repeated."""
    per_item = []
    for t, h, w in grid_thw:
        rows = torch.arange(h).view(h // merge_size, merge_size, 1, 1).expand(-1, -1, w // merge_size, merge_size)
        cols = torch.arange(w).view(1, 1, w // merge_size, merge_size).expand(h // merge_size, merge_size, -1, -1)
        # (h/m, m, w/m, m) -> block-major (h/m, w/m, m, m)
        rows, cols = rows.permute(0, 2, 1, 3).flatten(), cols.permute(0, 2, 1, 3).flatten()
        per_item.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))  # (t*h*w, 2)
    return torch.cat(per_item)


class VisionRotaryEmbedding(nn.Module):
    """Axial 2-D RoPE of the vision tower: the first half of the rotated
    frequencies follow the patch row, the second half the patch column."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim // 2, theta), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (N, 2) -> cos, sin (N, head_dim) fp32."""
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq  # (N, 2, D/4)
        freqs = freqs.flatten(1)  # (N, D/2): [row freqs | col freqs]
        emb = torch.cat((freqs, freqs), dim=-1)  # (N, D)
        return emb.cos(), emb.sin()
