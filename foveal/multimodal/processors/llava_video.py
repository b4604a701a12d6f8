"""LLaVA video: OneVision's frames, and a clear refusal for LLaVA-1.5 / NeXT.

OneVision (transformers' LlavaOnevisionVideoProcessor): every sampled frame
is resized to the tower's square input (Pillow bicubic here; transformers
uses torchvision, whose bicubic differs in the last bit, so parity tests feed
both models the same frames), rescaled and normalized. The model pools each
frame's side x side features 2x2 (bilinear, ceil) and ends the video with one
newline row: frames * ceil(side / 2)^2 + 1 tokens, whatever the clip's size.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from foveal.errors import InvalidRequestError
from foveal.multimodal.hashing import mm_hash
from foveal.multimodal.media.video import DecodedVideo, VideoSampling
from foveal.multimodal.processors.family import check_video_overrides
from foveal.multimodal.processors.llava import LlavaImageProcessor

# mm_processor_kwargs key -> field
OVERRIDE_KEYS = {"fps": "fps", "min_frames": "min_frames", "max_frames": "max_frames"}


def video_tokens(num_frames: int, feature_side: int) -> int:
    return num_frames * math.ceil(feature_side / 2) ** 2 + 1


@dataclass(frozen=True)
class LlavaProcessedVideo:
    pixel_values_videos: torch.Tensor  # (frames, C, S, S) float32
    num_tokens: int
    mm_hash: str
    modality = "video"

    def feature_data(self) -> dict[str, Any]:
        return {"pixel_values_videos": self.pixel_values_videos}


@dataclass(frozen=True)
class LlavaVideoProcessor:
    """`frame` holds the normalization and the tower side; None: the model takes no video."""

    frame: LlavaImageProcessor | None = None
    fps: float = 1.0
    min_frames: int = 4
    max_frames: int = 32

    @classmethod
    def from_pretrained(cls, path: str, overrides: dict | None = None) -> "LlavaVideoProcessor":
        from foveal.multimodal.processors.llava_family import processor_from_checkpoint

        image = processor_from_checkpoint(path)
        frame = image if image.variant == "llava_onevision" else None
        return cls(frame=frame).with_overrides(overrides or {})

    def with_overrides(self, overrides: dict) -> "LlavaVideoProcessor":
        if overrides and self.frame is None:
            raise InvalidRequestError(f"mm_processor_kwargs {sorted(overrides)} are for videos; "
                                      "this LLaVA model takes images only")
        check_video_overrides(overrides, OVERRIDE_KEYS)
        frames = {k: int(v) for k, v in overrides.items() if k.endswith("frames")}
        fps = {"fps": float(overrides["fps"])} if "fps" in overrides else {}
        processor = dataclasses.replace(self, **frames, **fps)
        if processor.min_frames > processor.max_frames:
            raise InvalidRequestError(f"min_frames ({processor.min_frames}) is larger than max_frames "
                                      f"({processor.max_frames}); lower min_frames or raise max_frames")
        return processor

    @property
    def takes_video(self) -> bool:
        return self.frame is not None

    def refusal(self) -> str:
        return "this LLaVA model takes images only (LLaVA-OneVision takes videos); send video frames as images"

    @property
    def sampling(self) -> VideoSampling:
        return VideoSampling(fps=self.fps, min_frames=self.min_frames, max_frames=self.max_frames,
                             frame_factor=1)

    def with_max_pixels(self, max_pixels: int) -> "LlavaVideoProcessor":
        return self  # every frame is seen at the tower's one size

    def tensor_params(self) -> dict[str, Any]:
        return {**(self.frame.tensor_params() if self.frame else {}), "processor": "llava_video"}

    def num_tokens(self, num_frames: int) -> int:
        return video_tokens(num_frames, self.frame.feature_side)

    def process(self, video: DecodedVideo) -> LlavaProcessedVideo:
        if self.frame is None:
            raise InvalidRequestError(self.refusal())
        side = self.frame.tile_size
        frames = np.stack([self.frame.normalize(np.asarray(
            Image.fromarray(f).resize((side, side), resample=Image.Resampling(self.frame.resample))
            if f.shape[:2] != (side, side) else f)) for f in video.frames])  # (F, S, S, C)
        return LlavaProcessedVideo(
            pixel_values_videos=torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous(),
            num_tokens=self.num_tokens(len(video.frames)),
            mm_hash=mm_hash(video.content_hash, {**self.tensor_params(), "timestamps": video.timestamps}))
