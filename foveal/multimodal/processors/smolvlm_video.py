"""SmolVLM (SmolVLM2) video: each sampled frame is one tile-sized view, and the
video's placeholder becomes the text transformers' SmolVLMProcessor writes:

    "You are provided the following series of {three} frames from a {0:00:05}
    [H:MM:SS] video.\\n" + per frame "\\nFrame from {MM:SS}:" + one image's
    markers and <image> run + "\\n\\n"

Frames (transformers' SmolVLMVideoProcessor): resized so the longest edge is
`video_size` (aspect kept, the short side made even), then squeezed to the
tower's square input, rescaled and normalized like images. Pillow's resampling
here, torchvision's in transformers (the last bits differ, so parity tests
feed both the same frames). Frame sampling is the engine's (`VideoSampling`:
`fps` frames per second up to `max_frames`, spread evenly over the clip);
transformers' own sampler also skips a second at each end of long clips.

The item's feature holds the frames as views and its placeholder runs from the
first frame's first <image> token to the last frame's last, timestamps and
markers included (the intro and outro text sit outside it): the Idefics3
model embeds it as an image of several views.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from foveal.errors import InvalidRequestError
from foveal.multimodal.hashing import mm_hash
from foveal.multimodal.media.video import DecodedVideo, VideoSampling
from foveal.multimodal.processors.family import check_video_overrides
from foveal.multimodal.processors.idefics3 import Idefics3ImageProcessor, MarkerTokens, rescaled_size
from foveal.multimodal.processors.qwen2_vl import Qwen2VLImageProcessor

# mm_processor_kwargs key -> field
OVERRIDE_KEYS = {"fps": "fps", "max_frames": "max_frames"}
VIDEO_INTRO = "You are provided the following series of {count} frames from a {duration} [H:MM:SS] video.\n"
FRAME_PROMPT = "\nFrame from {minutes:02d}:{seconds:02d}:"
VIDEO_OUTRO = "\n\n"


def video_prompt(markers: MarkerTokens, image_seq_len: int, timestamps: list[float],
                 duration: float) -> str:
    """What transformers' SmolVLMProcessor writes for one video's placeholder."""
    from num2words import num2words

    frame = f"{markers.fake}{markers.global_image}{markers.image * image_seq_len}{markers.fake}"
    text = VIDEO_INTRO.format(count=num2words(len(timestamps)),
                              duration=datetime.timedelta(seconds=int(duration)))
    for second in timestamps:
        text += FRAME_PROMPT.format(minutes=int(second // 60), seconds=int(second % 60)) + frame
    return text + VIDEO_OUTRO


@dataclass(frozen=True)
class ProcessedSmolVLMVideo:
    pixel_values: torch.Tensor  # (frames, C, S, S) float32: one view per frame
    timestamps: tuple[float, ...]  # seconds, one per frame
    duration: float  # of the whole clip, seconds
    image_seq_len: int
    num_tokens: int  # <image> tokens: frames * image_seq_len
    mm_hash: str
    markers: MarkerTokens
    modality = "video"

    def feature_data(self) -> dict[str, Any]:
        return {"pixel_values": self.pixel_values}

    def prompt_text(self) -> str:
        return video_prompt(self.markers, self.image_seq_len, list(self.timestamps), self.duration)


@dataclass(frozen=True)
class SmolVLMVideoProcessor:
    """`frame` holds the tower side, normalization and markers; None: the checkpoint
    takes no video (its tokenizer has no single video token)."""

    frame: Idefics3ImageProcessor | None = None
    video_size: int = 4 * 364  # longest edge before the squeeze to the tower side
    fps: float = 1.0
    max_frames: int = 64
    reason: str = "this SmolVLM checkpoint takes no video; send video frames as images"

    @classmethod
    def from_pretrained(cls, path: str, overrides: dict | None = None) -> "SmolVLMVideoProcessor":
        from foveal.loader.hf_config import model_config_from_hf

        folder = pathlib.Path(path or "")
        if model_config_from_hf(str(folder)).video_token_id < 0:
            return cls(reason=f"{folder}'s tokenizer has no single video token for SmolVLM's "
                              "<video> placeholder; add it to tokenizer_config.json's "
                              "added_tokens_decoder, or send video frames as images"
                       ).with_overrides(overrides or {})
        image = Idefics3ImageProcessor.from_pretrained(str(folder))
        settings = _video_settings(folder)
        size = (settings.get("video_size") or {}).get("longest_edge", image.configured_edge)
        processor = cls(frame=image, video_size=int(size), fps=float(settings.get("fps", 1.0)),
                        max_frames=int(settings.get("max_frames", 64)))
        return processor.with_overrides(overrides or {})

    def with_overrides(self, overrides: dict) -> "SmolVLMVideoProcessor":
        if overrides and self.frame is None:
            raise InvalidRequestError(f"mm_processor_kwargs {sorted(overrides)} are for videos; "
                                      + self.reason)
        check_video_overrides(overrides, OVERRIDE_KEYS)
        values = {"fps": float(overrides["fps"])} if "fps" in overrides else {}
        if "max_frames" in overrides:
            values["max_frames"] = int(overrides["max_frames"])
        return dataclasses.replace(self, **values)

    @property
    def takes_video(self) -> bool:
        return self.frame is not None

    def refusal(self) -> str:
        return self.reason

    @property
    def sampling(self) -> VideoSampling:
        return VideoSampling(fps=self.fps, min_frames=1, max_frames=self.max_frames, frame_factor=1)

    def with_max_pixels(self, max_pixels: int) -> "SmolVLMVideoProcessor":
        return self  # every frame is one tower-sized view: the planner drops frames only

    def num_tokens(self, num_frames: int) -> int:
        return num_frames * self.frame.image_seq_len

    def tensor_params(self) -> dict[str, Any]:
        frame = self.frame.tensor_params() if self.frame else {}
        return {**frame, "processor": "smolvlm_video", "video_size": self.video_size}

    def process(self, video: DecodedVideo) -> ProcessedSmolVLMVideo:
        if self.frame is None:
            raise InvalidRequestError(self.reason)
        side, resample = self.frame.tile_size, Image.Resampling(self.frame.resample)
        views = []
        for pixels in video.frames:
            frame = Image.fromarray(pixels)
            height, width = rescaled_size(frame.height, frame.width, self.video_size)
            frame = frame.resize((width, height), resample).resize((side, side), resample)
            views.append(Qwen2VLImageProcessor.normalize(self.frame, np.asarray(frame)))
        pixel_values = torch.from_numpy(np.stack(views)).permute(0, 3, 1, 2).contiguous()  # (F, C, S, S)
        duration = video.source.duration
        params = {**self.tensor_params(), "timestamps": video.timestamps, "duration": int(duration)}
        return ProcessedSmolVLMVideo(pixel_values, tuple(video.timestamps), duration,
                                     self.frame.image_seq_len,
                                     self.num_tokens(len(video.frames)),
                                     mm_hash(video.content_hash, params), self.frame.markers)


def _video_settings(folder: pathlib.Path) -> dict:
    """SmolVLM's "video_sampling" block (fps, max_frames, video_size): in
    video_preprocessor_config.json, or preprocessor_config.json as the hub
    checkpoints ship it."""
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        path = folder / name
        if path.is_file():
            settings = json.loads(path.read_text()).get("video_sampling")
            if settings:
                return settings
    return {}
