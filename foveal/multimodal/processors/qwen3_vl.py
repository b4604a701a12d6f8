"""Qwen3-VL image / video processors and placeholder expansion.

Images are processed exactly like Qwen2-VL's (transformers maps qwen3_vl to
`Qwen2VLImageProcessor`) with Qwen3-VL's defaults: 16-pixel patches, so one
visual token per 32 x 32 pixels, and mean = std = 0.5.

Videos follow transformers' `Qwen3VLVideoProcessor`: the pixel bounds
(size shortest_edge / longest_edge) cover the whole clip (frames x height x
width), so longer clips get smaller frames. The planner's per-frame cap
(`with_max_pixels`) lowers that bound further: max(clip) = min(longest_edge,
cap * frames), which equals a per-frame bound whenever the cap binds.

A video's placeholder becomes, per temporal patch (two frames), the patch's
mid time as text, "<1.5 seconds>", then <|vision_start|>, its visual tokens,
<|vision_end|>; these replace the template's <|vision_start|><|video_pad|>
<|vision_end|> (the layout Qwen3-VL was trained on).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from foveal.errors import ConfigError, MediaError
from foveal.multimodal.hashing import mm_hash
from foveal.multimodal.inputs import MMFeature, PlaceholderRange
from foveal.multimodal.media.video import DecodedVideo
from foveal.multimodal.processors.qwen2_vl import Qwen2VLImageProcessor, expand_mm_placeholders
from foveal.multimodal.processors.qwen2_vl_video import ProcessedVideo, Qwen2VLVideoProcessor

QWEN3_VL_MEAN = (0.5, 0.5, 0.5)
QWEN3_VL_STD = (0.5, 0.5, 0.5)
VIDEO_MIN_PIXELS = 128 * 32 * 32  # transformers' defaults, over the whole clip
VIDEO_MAX_PIXELS = 768 * 32 * 32


@dataclass(frozen=True)
class Qwen3VLImageProcessor(Qwen2VLImageProcessor):
    min_pixels: int = 65536
    max_pixels: int = 16777216
    patch_size: int = 16
    image_mean: tuple[float, float, float] = QWEN3_VL_MEAN
    image_std: tuple[float, float, float] = QWEN3_VL_STD

    def to_config_dict(self) -> dict[str, Any]:
        return {**super().to_config_dict(), "processor_class": "Qwen3VLProcessor"}

    def tensor_params(self) -> dict[str, Any]:
        return {**super().tensor_params(), "processor": "qwen3_vl_image"}


@dataclass(frozen=True)
class Qwen3ProcessedVideo(ProcessedVideo):
    patch_times: tuple[float, ...] = ()  # mid time of each temporal patch, in seconds


def clip_smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                      min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) of every frame: multiples of `factor`, with frames x height
    x width near [min_pixels, max_pixels]; rounding as in transformers."""
    if height <= 0 or width <= 0:
        raise MediaError(f"video frames are {width}x{height}: they have no pixels")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"video frames are {width}x{height}, aspect ratio over 200:1; crop or pad them")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def capped_clip_size(num_frames: int, width: int, height: int, temporal_factor: int, factor: int,
                     clip_min_pixels: int, clip_max_pixels: int, frame_cap: int | None
                     ) -> tuple[int, int]:
    """(height, width) of a clip's frames: the clip bounds, the upper one
    lowered to frame_cap per frame (the planner's choice) when that is smaller."""
    clip_frames = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)
    max_pixels = clip_max_pixels if frame_cap is None else min(clip_max_pixels, frame_cap * clip_frames)
    return clip_smart_resize(max(num_frames, temporal_factor), height, width, temporal_factor, factor,
                             clip_min_pixels, max_pixels)


@dataclass(frozen=True)
class Qwen3VLVideoProcessor(Qwen2VLVideoProcessor):
    """`frame` holds the frame pipeline; its min/max_pixels are the clip bounds
    (and the planner's per-frame range); `frame_cap` is the planner's per-frame cap."""

    frame_cap: int | None = None

    @classmethod
    def from_config(cls, config: dict, overrides: dict | None = None) -> "Qwen3VLVideoProcessor":
        size = config.get("size") or {}
        bounds = {
            "min_pixels": config.get("min_pixels") or size.get("shortest_edge") or VIDEO_MIN_PIXELS,
            "max_pixels": config.get("max_pixels") or size.get("longest_edge") or VIDEO_MAX_PIXELS,
        }
        frame = Qwen3VLImageProcessor.from_config({**config, **bounds})
        processor = cls(frame=frame, fps=float(config.get("fps") or 2.0),
                        min_frames=int(config.get("min_frames", 4)),
                        max_frames=int(config.get("max_frames", 768)))
        return processor.with_overrides(overrides or {})

    def with_max_pixels(self, max_pixels: int) -> "Qwen3VLVideoProcessor":
        return dataclasses.replace(self, frame_cap=max_pixels)

    def tensor_params(self) -> dict[str, Any]:
        return {**self.frame.tensor_params(), "processor": "qwen3_vl_video", "frame_cap": self.frame_cap}

    def resized_size(self, num_frames: int, width: int, height: int) -> tuple[int, int]:
        frame = self.frame
        return capped_clip_size(num_frames, width, height, frame.temporal_patch_size, frame.resize_factor,
                                frame.min_pixels, frame.max_pixels, self.frame_cap)

    def process(self, video: DecodedVideo) -> Qwen3ProcessedVideo:
        """Resize (clip bounds), normalize and patchify the sampled frames."""
        height, width = video.frames[0].shape[:2]
        resized_h, resized_w = self.resized_size(len(video.frames), width, height)
        frames = np.stack([self.frame.normalize(np.asarray(self.frame.resize_frame(
            Image.fromarray(f), resized_h, resized_w))) for f in video.frames])  # (F, H, W, C) float32
        pixel_values, grid_thw = self._patchify(torch.from_numpy(frames))
        T = self.frame.temporal_patch_size
        params = {**self.tensor_params(), "timestamps": video.timestamps}
        return Qwen3ProcessedVideo(
            pixel_values_videos=pixel_values, grid_thw=grid_thw,
            second_per_grid_t=T / video.sampled_fps, timestamps=tuple(video.timestamps),
            num_tokens=math.prod(grid_thw) // self.frame.merge_size ** 2,
            mm_hash=mm_hash(video.content_hash, params),
            patch_times=tuple(patch_times(video.timestamps, T)))


def patch_times(timestamps: tuple[float, ...] | list[float], temporal_patch_size: int) -> list[float]:
    """Mid time of each temporal patch: the mean of its first and last frame's
    time (a short last patch repeats the last frame), as transformers computes it."""
    times = list(timestamps)
    times += [times[-1]] * (-len(times) % temporal_patch_size)
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(times), temporal_patch_size)]


def timestamp_text(seconds: float) -> str:
    return f"<{seconds:.1f} seconds>"


def expand_without_tokenizer(token_ids: list[int], items_by_modality: dict[str, tuple[int, list]]
                             ) -> tuple[list[int], list[MMFeature]]:
    """Images expand as in Qwen2-VL; a video's timestamps need the tokenizer."""
    if items_by_modality.get("video", (None, []))[1]:
        raise ConfigError("Qwen3-VL video placeholders hold timestamps as text; expand them with "
                          "ProcessorFamily.expander(tokenizer)")
    return expand_mm_placeholders(token_ids, items_by_modality)


def qwen3_vl_expander(tokenizer):
    """tokenizer -> the placeholder expansion of Qwen3-VL prompts (see module docstring)."""
    start = tokenizer.token_to_id("<|vision_start|>")
    end = tokenizer.token_to_id("<|vision_end|>")
    if start is None or end is None:
        raise ConfigError("the tokenizer lacks <|vision_start|> / <|vision_end|>, which Qwen3-VL "
                          "prompts need; use the checkpoint's own tokenizer")

    def expand(token_ids: list[int], items_by_modality: dict[str, tuple[int, list]]
               ) -> tuple[list[int], list[MMFeature]]:
        ids, features = expand_mm_placeholders(token_ids, items_by_modality)
        pad, videos = items_by_modality.get("video", (None, []))
        videos = iter(videos)
        out: list[int] = []
        result: list[MMFeature] = []
        cursor = 0
        for feature in features:
            lo, hi = feature.placeholder.offset, feature.placeholder.end
            if feature.modality != "video":
                out += ids[cursor:lo]
                result.append(dataclasses.replace(feature, placeholder=PlaceholderRange(len(out), hi - lo)))
                out += ids[lo:hi]
                cursor = hi
                continue
            wrapped = 0 < lo and hi < len(ids) and ids[lo - 1] == start and ids[hi] == end
            out += ids[cursor:lo - 1] if wrapped else ids[cursor:lo]
            cursor = hi + 1 if wrapped else hi
            range_ids, data = _video_range(next(videos), feature, tokenizer, pad, start, end)
            result.append(dataclasses.replace(feature, placeholder=PlaceholderRange(len(out), len(range_ids)),
                                              data=data))
            out += range_ids
        out += ids[cursor:]
        return out, result

    return expand


def _video_range(video: "Qwen3ProcessedVideo", feature: MMFeature, tokenizer, pad: int, start: int,
                 end: int) -> tuple[list[int], dict[str, Any]]:
    """The token ids of one video's range and its feature data (+ per-frame text)."""
    grid_t = video.grid_thw[0]
    per_patch = video.num_tokens // grid_t
    texts, range_ids = [], []
    for index, seconds in enumerate(video.patch_times):
        text = ([end] if index else []) + tokenizer.encode(timestamp_text(seconds)) + [start]
        texts.append(tuple(text))
        range_ids += text + [pad] * per_patch
    range_ids.append(end)
    data = {**feature.data, "frame_text_ids": tuple(texts), "tail_ids": (end,)}
    return range_ids, data
