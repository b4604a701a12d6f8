"""LLaVA image processing: 1.5 (one fixed-size view) and anyres (NeXT, OneVision).

LLaVA-1.5 (transformers' CLIPImageProcessor): resize the shortest edge to
`shortest_edge`, center-crop `tile_size` square, rescale, normalize: one view,
a fixed token count whatever the image size.

Anyres (LlavaNextImageProcessor / LlavaOnevisionImageProcessor): a canvas is
picked among `grid_pinpoints` (height, width) by `select_best_resolution`; the
image is resized into it keeping its aspect ratio, padded with black to the
canvas, and cut row-major into tile_size tiles. The first view is the whole
image squashed to tile_size x tile_size. Tokens: the base view's rows, then
the tiles' feature grid with the padding removed ("unpadded"), OneVision
pooled down to at most `max_tiles` tiles' worth, plus one newline per row.

OneVision's multi-image mode (`in_prompt_of(n)` with n > 1, as transformers'
processor does for a prompt of several images): each image is padded to a
square with the mean colour and squashed to one view; tokens: that view's rows
and one newline. The mode is in `tensor_params`, so an image's cache entries
differ between one-image and several-image prompts.

The numbers equal transformers' PIL processors: Pillow resizes uint8 images,
rescale in float64 then float32, normalize in float32.

The budget planner's dial is `max_pixels`: anyres keeps only the canvases of
at most max_pixels (fewer tiles, fewer tokens); LLaVA-1.5 has one size, so
its cost is fixed and a budget below it is refused.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from foveal.errors import ConfigError, InvalidRequestError, MediaError
from foveal.multimodal.hashing import hash_image, mm_hash
from foveal.multimodal.media.image import to_rgb
from foveal.multimodal.processors.qwen2_vl import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

OVERRIDE_KEYS = ("max_pixels",)  # anyres only
_RESAMPLE = {int(f): f for f in Image.Resampling}


def select_best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """The (height, width) canvas keeping most of the image and wasting least (transformers' rule)."""
    best, best_effective, best_wasted = None, 0, float("inf")
    for canvas_h, canvas_w in pinpoints:
        scale = min(canvas_w / width, canvas_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = canvas_w * canvas_h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (canvas_h, canvas_w), effective, wasted
    return best


def fit_size(height: int, width: int, canvas_h: int, canvas_w: int) -> tuple[int, int]:
    """(height, width) of the image resized into the canvas, aspect kept (rounding up)."""
    scale_w, scale_h = canvas_w / width, canvas_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), canvas_h), canvas_w
    return canvas_h, min(math.ceil(width * scale_h), canvas_w)


def unpadded_grid(height: int, width: int, grid_h: int, grid_w: int) -> tuple[int, int]:
    """Feature rows x cols of a (grid_h, grid_w) feature grid once the canvas padding
    around a height x width image is cut away (transformers' unpad_image)."""
    if width / height > grid_w / grid_h:
        new_h = int(round(height * (grid_w / width), 7))
        return grid_h - (grid_h - new_h) // 2 * 2, grid_w
    new_w = int(round(width * (grid_h / height), 7))
    return grid_h, grid_w - (grid_w - new_w) // 2 * 2


def pooled_grid(rows: int, cols: int, side: int, max_tiles: int) -> tuple[int, int]:
    """OneVision anyres_max_N: a grid over N tiles' worth (ratio > 1.1) is shrunk by the ratio."""
    if not max_tiles:
        return rows, cols
    ratio = math.sqrt(rows * cols / (max_tiles * side ** 2))
    return (int(rows // ratio), int(cols // ratio)) if ratio > 1.1 else (rows, cols)


def anyres_tile_tokens(height: int, width: int, tiles: tuple[int, int], side: int,
                       max_tiles: int) -> int:
    """Tokens of the tiles' features (unpadded, pooled, a newline per row), without the base view."""
    rows, cols = unpadded_grid(height, width, tiles[0] * side, tiles[1] * side)
    rows, cols = pooled_grid(rows, cols, side, max_tiles)
    return rows * cols + rows


@dataclass(frozen=True)
class LlavaProcessedImage:
    pixel_values: torch.Tensor  # (views, C, tile, tile) float32: base view first, then tiles
    image_size: tuple[int, int]  # original (height, width)
    tile_grid: tuple[int, int]  # tiles (rows, cols); (0, 0) for LLaVA-1.5
    num_tokens: int
    mm_hash: str
    modality = "image"

    def feature_data(self) -> dict[str, Any]:
        return {"pixel_values": self.pixel_values, "image_size": self.image_size,
                "tile_grid": self.tile_grid}


@dataclass(frozen=True)
class LlavaImageProcessor:
    """Effective parameters; every field changes the tensors or the token count."""

    variant: str = "llava"  # "llava" | "llava_next" | "llava_onevision"
    tile_size: int = 336  # the vision tower's input side
    shortest_edge: int = 336  # LLaVA-1.5's resize before the center crop
    base_tokens: int = 576  # rows the projector gives per view (CLS kept or not)
    feature_side: int = 24  # tile_size // patch_size
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    max_tiles: int = 0
    max_pixels: int = 336 * 336  # anyres: the largest canvas area allowed
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = int(Image.Resampling.BICUBIC)
    single_view: bool = False  # OneVision in a prompt of several images: padded square, one view

    @property
    def anyres(self) -> bool:
        return self.variant != "llava" and not self.single_view

    def in_prompt_of(self, num_images: int) -> "LlavaImageProcessor":
        """The processor for the images of a prompt holding num_images images:
        OneVision switches to its multi-image mode above one."""
        if self.variant != "llava_onevision" or num_images <= 1 or self.single_view:
            return self
        side = self.tile_size
        return dataclasses.replace(self, single_view=True, max_pixels=side * side)

    @property
    def min_pixels(self) -> int:
        if not self.anyres:
            return self.max_pixels
        return min(h * w for h, w in self.grid_pinpoints)

    @classmethod
    def from_pretrained(cls, path: str, overrides: dict | None = None) -> "LlavaImageProcessor":
        from foveal.multimodal.processors.llava_family import processor_from_checkpoint

        return processor_from_checkpoint(path, overrides)

    def with_overrides(self, overrides: dict) -> "LlavaImageProcessor":
        """mm_processor_kwargs: anyres takes max_pixels (the largest canvas area)."""
        unknown = sorted(set(overrides) - set(OVERRIDE_KEYS))
        if unknown:
            raise InvalidRequestError(f"unknown mm_processor_kwargs {unknown}; the LLaVA image "
                                      f"processor accepts {list(OVERRIDE_KEYS)}")
        if "max_pixels" not in overrides or overrides["max_pixels"] == self.max_pixels:
            return self
        value = overrides["max_pixels"]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidRequestError(f"mm_processor_kwargs['max_pixels'] must be a positive int, "
                                      f"got {value!r}")
        if self.single_view:
            raise InvalidRequestError(
                f"in a prompt of several images LLaVA-OneVision sees each at {self.tile_size}x"
                f"{self.tile_size} ({self.base_tokens + 1} tokens); max_pixels cannot change that")
        if not self.anyres:
            raise InvalidRequestError(
                f"LLaVA-1.5 sees every image at {self.tile_size}x{self.tile_size} "
                f"({self.base_tokens} tokens); max_pixels cannot change that")
        if value < self.min_pixels:
            raise InvalidRequestError(f"max_pixels={value} is below the smallest anyres canvas "
                                      f"({self.min_pixels} pixels); raise it")
        return dataclasses.replace(self, max_pixels=value)

    def canvases(self) -> list[tuple[int, int]]:
        return [(h, w) for h, w in self.grid_pinpoints if h * w <= self.max_pixels]

    def num_tokens_for_size(self, width: int, height: int) -> int:
        """Visual tokens an image of this size takes, without processing it."""
        if self.single_view:
            return self.base_tokens + 1  # the view's rows, then one newline
        if not self.anyres:
            return self.base_tokens
        canvas_h, canvas_w = select_best_resolution(height, width, self.canvases())
        tiles = (canvas_h // self.tile_size, canvas_w // self.tile_size)
        return self.base_tokens + anyres_tile_tokens(height, width, tiles, self.feature_side, self.max_tiles)

    def tensor_params(self) -> dict[str, Any]:
        return {"processor": "llava_image", **dataclasses.asdict(self)}

    def process(self, image: Image.Image) -> LlavaProcessedImage:
        rgb = to_rgb(image)
        if rgb.width <= 0 or rgb.height <= 0:
            raise MediaError(f"image is {rgb.width}x{rgb.height}: it has no pixels")
        if self.single_view:
            views, grid = [self._resize(self._square(rgb), self.tile_size, self.tile_size)], (0, 0)
        elif self.anyres:
            views, grid = self._anyres_views(rgb)
        else:
            views, grid = [self._center_view(rgb)], (0, 0)
        pixels = np.stack([self.normalize(np.asarray(view)) for view in views])  # (V, S, S, C)
        return LlavaProcessedImage(
            pixel_values=torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous(),
            image_size=(rgb.height, rgb.width), tile_grid=grid,
            num_tokens=self.num_tokens_for_size(rgb.width, rgb.height),
            mm_hash=mm_hash(hash_image(rgb), self.tensor_params()))

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        if (height, width) == (image.height, image.width):
            return image
        return image.resize((width, height), resample=_RESAMPLE[self.resample])

    def _center_view(self, image: Image.Image) -> Image.Image:
        short, long = sorted((image.width, image.height))
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        if image.width <= image.height:
            resized = self._resize(image, new_long, new_short)
        else:
            resized = self._resize(image, new_short, new_long)
        top = (resized.height - self.tile_size) // 2
        left = (resized.width - self.tile_size) // 2
        if top < 0 or left < 0:
            raise ConfigError(f"shortest_edge {self.shortest_edge} is below the crop size {self.tile_size}")
        return resized.crop((left, top, left + self.tile_size, top + self.tile_size))

    def _square(self, image: Image.Image) -> Image.Image:
        """Padded to a square with the mean colour (truncated to uint8), the image centred."""
        side = max(image.width, image.height)
        if image.width == image.height:
            return image
        colour = tuple(int(x * 255) for x in self.image_mean)
        canvas = Image.new("RGB", (side, side), colour)
        canvas.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        return canvas

    def _anyres_views(self, image: Image.Image) -> tuple[list[Image.Image], tuple[int, int]]:
        canvas_h, canvas_w = select_best_resolution(image.height, image.width, self.canvases())
        new_h, new_w = fit_size(image.height, image.width, canvas_h, canvas_w)
        canvas = Image.new("RGB", (canvas_w, canvas_h), (0, 0, 0))
        canvas.paste(self._resize(image, new_h, new_w), ((canvas_w - new_w) // 2, (canvas_h - new_h) // 2))
        S = self.tile_size
        tiles = [canvas.crop((x, y, x + S, y + S))
                 for y in range(0, canvas_h, S) for x in range(0, canvas_w, S)]  # row-major
        return [self._resize(image, S, S), *tiles], (canvas_h // S, canvas_w // S)

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 (H, W, C) -> float32 (H, W, C) through a 256-entry table per channel
        holding exactly transformers' per-pixel result."""
        levels = np.arange(256, dtype=np.float64)
        table = (levels * self.rescale_factor if self.do_rescale else levels).astype(np.float32)
        table = np.repeat(table[:, None], 3, axis=1)  # (256, C)
        if self.do_normalize:
            table = (table - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        return table[pixels, np.arange(3)]
