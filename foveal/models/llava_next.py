"""LLaVA-NeXT and LLaVA-OneVision (images): LLaVA with anyres packing.

An image arrives as views (V, C, S, S): the whole image squashed to one view,
then the tiles of its canvas (rows x cols, row-major). Each view becomes
side x side projected features. An item's placeholder rows are the base view's
features, then the tiles' features laid out as one (rows*side, cols*side) grid
with the canvas padding cut away (OneVision: bilinearly shrunk to at most
max_tiles tiles' worth), row by row, each row ended by the learned
`image_newline` embedding. OneVision in a prompt of several images sends one
view per image (tile grid (0, 0)): its rows, then one newline. The processor
(multimodal/processors/llava.py) counts the same rows, with the same functions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foveal.config import ModelConfig
from foveal.models.llava import LlavaForConditionalGeneration
from foveal.multimodal.inputs import MMFeature
from foveal.multimodal.processors.llava import pooled_grid, unpadded_grid


class ImageNewline(nn.Module):
    """Holds the (hidden,) newline row; a module so the weight tables can name it."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.embedding = nn.Parameter(torch.empty(hidden_size), requires_grad=False)


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.image_newline = ImageNewline(config.text.hidden_size)
        self.side = self.settings.image_size // config.vision.patch_size

    def pack_item(self, feature: MMFeature, views: torch.Tensor) -> torch.Tensor:
        """(V, side*side, hidden) -> (base rows + unpadded tile rows with newlines, hidden)."""
        base, tiles = views[0], views[1:]
        grid_rows, grid_cols = (int(x) for x in feature.data["tile_grid"])
        if grid_rows == 0:  # OneVision's multi-image mode: one padded-square view, one newline
            return torch.cat([base, self.image_newline.embedding.to(base.dtype)[None]])
        height, width = (int(x) for x in feature.data["image_size"])
        side, hidden = self.side, views.shape[-1]
        grid = tiles.view(grid_rows, grid_cols, side, side, hidden)
        grid = grid.permute(4, 0, 2, 1, 3).reshape(hidden, grid_rows * side, grid_cols * side)  # (D, H, W)
        rows, cols = unpadded_grid(height, width, grid.shape[1], grid.shape[2])
        top, left = (grid.shape[1] - rows) // 2, (grid.shape[2] - cols) // 2
        grid = grid[:, top:top + rows, left:left + cols]
        pooled = pooled_grid(rows, cols, side, self.settings.max_tiles)
        if pooled != (rows, cols):
            grid = F.interpolate(grid[None], list(pooled), mode="bilinear")[0]
        newline = self.image_newline.embedding.to(grid.dtype)[:, None, None].expand(hidden, grid.shape[1], 1)
        grid = torch.cat([grid, newline], dim=-1)  # (D, rows, cols + 1)
        return torch.cat([base, grid.flatten(1).transpose(0, 1)])  # (N, hidden)


class LlavaOnevisionForConditionalGeneration(LlavaNextForConditionalGeneration):
    """SigLIP tower, Qwen2 decoder, anyres_max_N pooling (LlavaSettings.max_tiles) and videos."""

    def pack_video(self, frames: torch.Tensor) -> torch.Tensor:
        """(F, side*side, hidden) -> (F * ceil(side/2)^2 + 1, hidden): each frame's grid pooled
        2x2 (bilinear), the frames in order, one newline row at the end."""
        num_frames, _, hidden = frames.shape
        grid = frames.view(num_frames, self.side, self.side, hidden).permute(0, 3, 1, 2)  # (F, D, s, s)
        pooled_side = -(-self.side // 2)
        grid = F.interpolate(grid, size=[pooled_side, pooled_side], mode="bilinear")
        rows = grid.permute(0, 2, 3, 1).reshape(-1, hidden)  # (F * p * p, D)
        return torch.cat([rows, self.image_newline.embedding.to(rows.dtype)[None]])
