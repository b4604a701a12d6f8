"""Qwen2-VL / Qwen2.5-VL video processor.

Every sampled frame is resized like an image (smart_resize, with the video
processor's own pixel bounds), rescaled and normalized; consecutive groups of
temporal_patch_size frames form one temporal patch (a clip with an odd frame
count repeats its last frame). Rows are ordered temporal patch by temporal
patch, each merge window by merge window, as in transformers'
`Qwen2VLVideoProcessor.patchify`.

Configuration follows transformers' lookup: `processor_config.json`'s nested
"video_processor", else `video_preprocessor_config.json`, else
`preprocessor_config.json`; pixel bounds a file does not set take the video
defaults (128 * 28 * 28 .. 768 * 28 * 28), not the image ones. Frames are
resized with Pillow (transformers uses torchvision, whose bicubic differs in
the last bit), so parity tests feed both models the same patches.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from foveal.errors import CheckpointError, InvalidRequestError
from foveal.multimodal.hashing import mm_hash
from foveal.multimodal.media.video import DecodedVideo, VideoSampling
from foveal.multimodal.processors.family import check_video_overrides
from foveal.multimodal.processors.qwen2_vl import Qwen2VLImageProcessor

VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
# mm_processor_kwargs key -> field of Qwen2VLVideoProcessor.
OVERRIDE_KEYS = {"video_min_pixels": "min_pixels", "video_max_pixels": "max_pixels",
                 "fps": "fps", "min_frames": "min_frames", "max_frames": "max_frames"}
_CONFIG_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")


@dataclass(frozen=True)
class ProcessedVideo:
    pixel_values_videos: torch.Tensor  # (num_patches, C * T * P * P) float32
    grid_thw: tuple[int, int, int]  # (frames / T, resized_h / P, resized_w / P)
    second_per_grid_t: float  # seconds one temporal patch spans
    timestamps: tuple[float, ...]  # seconds of each sampled frame
    num_tokens: int
    mm_hash: str
    modality = "video"

    def feature_data(self) -> dict[str, Any]:
        return {"pixel_values_videos": self.pixel_values_videos, "grid_thw": self.grid_thw,
                "second_per_grid_t": self.second_per_grid_t}


@dataclass(frozen=True)
class Qwen2VLVideoProcessor:
    """Frame pipeline (an image processor with the video pixel bounds) plus sampling."""

    frame: Qwen2VLImageProcessor
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    @classmethod
    def from_config(cls, config: dict, overrides: dict | None = None) -> "Qwen2VLVideoProcessor":
        size = config.get("size") or {}
        bounds = {
            "min_pixels": config.get("min_pixels") or size.get("shortest_edge") or VIDEO_MIN_PIXELS,
            "max_pixels": config.get("max_pixels") or size.get("longest_edge") or VIDEO_MAX_PIXELS,
        }
        frame = Qwen2VLImageProcessor.from_config({**config, **bounds})
        processor = cls(frame=frame, fps=float(config.get("fps") or 2.0),
                        min_frames=int(config.get("min_frames", 4)),
                        max_frames=int(config.get("max_frames", 768)))
        return processor.with_overrides(overrides or {})

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path, overrides: dict | None = None) -> "Qwen2VLVideoProcessor":
        folder = pathlib.Path(path)
        nested = folder / "processor_config.json"
        if nested.exists():
            config = _read_json(nested).get("video_processor")
            if config is not None:
                return cls.from_config(config, overrides)
        for name in _CONFIG_FILES:
            if (folder / name).exists():
                return cls.from_config(_read_json(folder / name), overrides)
        raise CheckpointError(f"{folder} has none of {list(_CONFIG_FILES)}; a Qwen2-VL checkpoint needs one")

    def with_overrides(self, overrides: dict) -> "Qwen2VLVideoProcessor":
        """Apply the video keys of mm_processor_kwargs; unknown keys are an error."""
        check_video_overrides(overrides, OVERRIDE_KEYS)
        pixels = {OVERRIDE_KEYS[k]: int(v) for k, v in overrides.items() if k.endswith("pixels")}
        frames = {OVERRIDE_KEYS[k]: int(v) for k, v in overrides.items() if k.endswith("frames")}
        fps = {"fps": float(overrides["fps"])} if "fps" in overrides else {}
        processor = dataclasses.replace(self, frame=self.frame.with_overrides(pixels), **frames, **fps)
        if processor.min_frames > processor.max_frames:
            raise InvalidRequestError(f"min_frames ({processor.min_frames}) is larger than max_frames "
                                      f"({processor.max_frames}); lower min_frames or raise max_frames")
        return processor

    @property
    def sampling(self) -> VideoSampling:
        return VideoSampling(fps=self.fps, min_frames=self.min_frames, max_frames=self.max_frames,
                             frame_factor=self.frame.temporal_patch_size)

    def with_max_pixels(self, max_pixels: int) -> "Qwen2VLVideoProcessor":
        return dataclasses.replace(self, frame=dataclasses.replace(self.frame, max_pixels=max_pixels))

    def tensor_params(self) -> dict[str, Any]:
        return {**self.frame.tensor_params(), "processor": "qwen2_vl_video"}

    def process(self, video: DecodedVideo) -> ProcessedVideo:
        """Resize, normalize and patchify the sampled frames of one video."""
        height, width = video.frames[0].shape[:2]
        resized_h, resized_w = self.frame.resized_size(width, height)
        frames = np.stack([self.frame.normalize(np.asarray(self.frame.resize_frame(
            Image.fromarray(f), resized_h, resized_w))) for f in video.frames])  # (F, H, W, C) float32
        pixel_values, grid_thw = self._patchify(torch.from_numpy(frames))
        T = self.frame.temporal_patch_size
        second_per_grid_t = T / video.sampled_fps
        params = {**self.tensor_params(), "timestamps": video.timestamps,
                  "second_per_grid_t": second_per_grid_t}
        return ProcessedVideo(
            pixel_values_videos=pixel_values, grid_thw=grid_thw,
            second_per_grid_t=second_per_grid_t, timestamps=tuple(video.timestamps),
            num_tokens=math.prod(grid_thw) // self.frame.merge_size ** 2,
            mm_hash=mm_hash(video.content_hash, params))

    def _patchify(self, frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        P, m, T = self.frame.patch_size, self.frame.merge_size, self.frame.temporal_patch_size
        if pad := -frames.shape[0] % T:
            frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])  # repeat the last frame
        num_frames, height, width, channels = frames.shape
        grid_t, grid_h, grid_w = num_frames // T, height // P, width // P
        patches = frames.view(grid_t, T, grid_h // m, m, P, grid_w // m, m, P, channels)
        patches = patches.permute(0, 2, 5, 3, 6, 8, 1, 4, 7)  # (gt, gh/m, gw/m, m, m, C, T, P, P)
        pixel_values = patches.reshape(grid_t * grid_h * grid_w, channels * T * P * P)
        return pixel_values, (grid_t, grid_h, grid_w)


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from exc
