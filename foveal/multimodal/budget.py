"""The downsampling planner: per-item resolution and frame count so that a
request's media fits its visual-token budget.

Policy (deterministic, pure integers):
1. Each item has a preferred setting and a floor.
   - image, detail "auto": preferred = the processor's max_pixels; floor =
     min_pixels. The planner may place it anywhere in between.
   - image, detail "high": pinned at the preferred setting (floor = preferred).
   - image, detail "low": pinned at a quarter of its "high" pixel area, i.e.
     about a quarter of the tokens (each side halved, on the 28-pixel grid).
   - video: preferred = the sampling rule's frame count (fps, min/max frames)
     at the video max_pixels; floor = min_frames frames at video min_pixels.
2. Without a budget, or when the preferred settings fit, every item gets them.
3. Otherwise water-filling: every item is offered min(preferred tokens, cap)
   and takes the largest setting whose tokens do not exceed its offer (never
   below its floor); the cap is the largest integer for which the total fits.
   Big items (long videos, huge images) are cut first; small ones keep their
   tokens until the cap reaches them.
4. A video meeting its offer drops frames first (keeping per-frame
   resolution) down to min_frames, and only then lowers the resolution.
5. If even the floors exceed the budget, MediaLimitError names the budget
   and the minimum the request needs.

A bigger budget never gives an item fewer tokens: offers grow with the cap,
and each item's tokens are a maximum over the settings its offer allows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Union

from foveal.errors import InvalidRequestError, MediaLimitError
from foveal.multimodal.processors.qwen2_vl import smart_resize

DETAILS = ("auto", "low", "high")
# Pixel levels an "auto" item may take between its floor and its preferred
# max_pixels: a geometric ladder with this ratio between steps.
_LADDER_RATIO = 0.9


@dataclass(frozen=True)
class Geometry:
    """The processor numbers that turn pixels and frames into tokens."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_min_pixels: int = 56 * 56
    image_max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    min_frames: int = 4

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def frame_tokens(self, width: int, height: int, min_pixels: int, max_pixels: int) -> int:
        """Tokens of one temporal patch (or one image) at these pixel bounds."""
        resized_h, resized_w = self.resized_size(width, height, min_pixels, max_pixels)
        return (resized_h // self.factor) * (resized_w // self.factor)

    def video_tokens(self, width: int, height: int, num_frames: int, min_pixels: int,
                     max_pixels: int) -> int:
        """Tokens of a video of num_frames frames at these pixel bounds."""
        temporal_patches = -(-num_frames // self.temporal_patch_size)
        return self.frame_tokens(width, height, min_pixels, max_pixels) * temporal_patches

    def resized_size(self, width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        """(height, width) the processor resizes a frame to at these pixel bounds; families
        with other resize rules subclass Geometry and override this and frame_tokens."""
        return smart_resize(height, width, self.factor, min_pixels, max_pixels)


@dataclass(frozen=True)
class ProcessorGeometry(Geometry):
    """Tokens through a family processor's own count at the planner's max_pixels, for
    families whose views are not Qwen-VL patches (Gemma 3 crops, Idefics3 tiles). The
    processor: `min_pixels`, `with_overrides({"max_pixels": n})`, `num_tokens_for_size(w, h)`."""

    processor: object | None = None

    def frame_tokens(self, width: int, height: int, min_pixels: int, max_pixels: int) -> int:
        if min(width, height) <= 0:
            return 0
        return self.at(max_pixels).num_tokens_for_size(width, height)

    def at(self, max_pixels: int):
        """The processor capped at max_pixels (never below its own minimum)."""
        return self.processor.with_overrides({"max_pixels": max(max_pixels, self.processor.min_pixels)})


@dataclass(frozen=True)
class ImageItem:
    width: int
    height: int
    detail: str = "auto"


@dataclass(frozen=True)
class VideoItem:
    width: int
    height: int
    num_frames: int  # frames the sampling rule would take (its preferred count)


MediaItem = Union[ImageItem, VideoItem]


@dataclass(frozen=True)
class ItemPlan:
    """The setting chosen for one item, in request order."""

    modality: str
    max_pixels: int
    num_frames: int  # sampled frames (videos); 1 for images
    num_tokens: int
    detail: str = "auto"
    width: int = 0  # frame size after resizing, in pixels
    height: int = 0
    downsampled: bool = False  # the budget gave it less than its preferred setting


@dataclass(frozen=True)
class MediaPlan:
    items: tuple[ItemPlan, ...]
    max_visual_tokens: int | None

    @property
    def total_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)


@dataclass(frozen=True)
class _Setting:
    tokens: int
    max_pixels: int
    num_frames: int


class _ItemOptions:
    """Every setting an item may take; `best(offer)` is the one the policy picks."""

    def __init__(self, item: MediaItem, geometry: Geometry) -> None:
        self.item, self.geometry = item, geometry
        self.modality = "image" if isinstance(item, ImageItem) else "video"
        self.detail = item.detail if isinstance(item, ImageItem) else "auto"
        if self.detail not in DETAILS:
            raise InvalidRequestError(f"image detail {self.detail!r} is not one of {DETAILS}")
        min_px, max_px = self._pixel_bounds()
        self.min_pixels = min_px
        self.pixel_levels = _ladder(min_px, max_px) if self.detail == "auto" else [max_px]
        top_frames = item.num_frames if isinstance(item, VideoItem) else 1
        self.preferred = self._setting(self.pixel_levels[0], top_frames)
        self.floor = self._setting(self.pixel_levels[-1], self._floor_frames(top_frames))

    def _pixel_bounds(self) -> tuple[int, int]:
        g = self.geometry
        if self.modality == "video":
            return g.video_min_pixels, g.video_max_pixels
        if self.detail != "low":
            return g.image_min_pixels, g.image_max_pixels
        high = g.frame_tokens(self.item.width, self.item.height, g.image_min_pixels, g.image_max_pixels)
        return g.image_min_pixels, max(g.image_min_pixels, high * g.factor ** 2 // 4)

    def _floor_frames(self, top_frames: int) -> int:
        if self.modality == "image":
            return 1
        T = self.geometry.temporal_patch_size
        return min(top_frames, max(T, -(-self.geometry.min_frames // T) * T))

    def _setting(self, max_pixels: int, num_frames: int) -> _Setting:
        g, item = self.geometry, self.item
        if self.modality == "video":
            tokens = g.video_tokens(item.width, item.height, num_frames, self.min_pixels, max_pixels)
        else:
            tokens = g.frame_tokens(item.width, item.height, self.min_pixels, max_pixels)
        return _Setting(tokens, max_pixels, num_frames)

    def best(self, offer: int) -> _Setting:
        """The largest setting within `offer` tokens: frames first, then pixels."""
        if offer >= self.preferred.tokens:
            return self.preferred
        if self.modality == "video":
            frames = self._frames_within(offer)
            if frames is not None:
                return self._setting(self.pixel_levels[0], frames)
        frames = self.floor.num_frames
        fitting = [s for s in (self._setting(px, frames) for px in self.pixel_levels) if s.tokens <= offer]
        return max([self.floor, *fitting], key=lambda s: s.tokens)

    def _frames_within(self, offer: int) -> int | None:
        T = self.geometry.temporal_patch_size
        per_patch = self.preferred.tokens // -(-self.preferred.num_frames // T)
        frames = min(self.preferred.num_frames, offer // per_patch * T)
        return frames if frames >= self.floor.num_frames else None


def _ladder(min_pixels: int, max_pixels: int) -> list[int]:
    """max_pixels, then 0.9x steps down, ending at min_pixels (descending)."""
    levels, level = [max_pixels], float(max_pixels)
    while level * _LADDER_RATIO > min_pixels:
        level *= _LADDER_RATIO
        levels.append(int(level))
    if levels[-1] != min_pixels:
        levels.append(min_pixels)
    return levels


def plan_media(items: Iterable[MediaItem], geometry: Geometry,
               max_visual_tokens: int | None = None) -> MediaPlan:
    """Choose every item's max_pixels and frame count (see the module docstring)."""
    options = [_ItemOptions(item, geometry) for item in items]
    if max_visual_tokens is not None and (isinstance(max_visual_tokens, bool) or max_visual_tokens <= 0):
        raise InvalidRequestError(f"max_visual_tokens must be a positive int, got {max_visual_tokens!r}")
    preferred = [o.preferred for o in options]
    if max_visual_tokens is None or sum(s.tokens for s in preferred) <= max_visual_tokens:
        return _plan(options, preferred, max_visual_tokens)
    minimum = sum(o.floor.tokens for o in options)
    if minimum > max_visual_tokens:
        raise MediaLimitError(
            f"the request's media need at least {minimum} visual tokens at the lowest resolution and "
            f"frame count; the budget is {max_visual_tokens} (max_visual_tokens): send fewer or "
            f"shorter items, use detail 'low'/'auto', or raise max_visual_tokens")
    low, high = 0, max(s.tokens for s in preferred)  # total(low) fits, total(high) does not
    while high - low > 1:
        cap = (low + high) // 2
        if sum(o.best(cap).tokens for o in options) <= max_visual_tokens:
            low = cap
        else:
            high = cap
    return _plan(options, [o.best(low) for o in options], max_visual_tokens)


def _plan(options: list[_ItemOptions], settings: list[_Setting], budget: int | None) -> MediaPlan:
    return MediaPlan(tuple(_item_plan(o, s) for o, s in zip(options, settings)), budget)


def _item_plan(option: _ItemOptions, setting: _Setting) -> ItemPlan:
    item = option.item
    height, width = option.geometry.resized_size(item.width, item.height, option.min_pixels,
                                                 setting.max_pixels)
    return ItemPlan(option.modality, setting.max_pixels, setting.num_frames, setting.tokens,
                    option.detail, width, height, downsampled=setting != option.preferred)
