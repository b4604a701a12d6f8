"""Qwen2-VL / Qwen2.5-VL image processor and placeholder expansion.

An image is resized so both sides are multiples of patch_size * merge_size and
its area lies in [min_pixels, max_pixels], rescaled and normalized, then cut
into patch_size x patch_size patches. Each patch is repeated temporal_patch_size
times (the vision tower's 3D patch embedding expects two frames; a still image
is a clip of identical frames). Output rows are ordered merge-window by
merge-window so the merger can fuse merge_size**2 neighbours into one token.

The numbers equal transformers' `Qwen2VLImageProcessorPil`: resize with Pillow
on uint8, rescale in float64 then float32, normalize in float32.
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

from foveal.errors import CheckpointError, ConfigError, InvalidRequestError, MediaError, PlaceholderMismatchError
from foveal.multimodal.hashing import hash_image, mm_hash
from foveal.multimodal.inputs import MMFeature, PlaceholderRange
from foveal.multimodal.media.image import to_rgb

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
# Per-request / LLM-level mm_processor_kwargs this processor accepts.
OVERRIDE_KEYS = ("min_pixels", "max_pixels")
_PIL_RESAMPLE_FILTERS = {int(f): f for f in Image.Resampling}


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # (num_patches, C * T * P * P) float32
    grid_thw: tuple[int, int, int]  # (1, resized_h / P, resized_w / P)
    num_tokens: int  # visual tokens after the merger: t * h * w // merge_size**2
    mm_hash: str
    modality = "image"

    def feature_data(self) -> dict[str, Any]:
        return {"pixel_values": self.pixel_values, "grid_thw": self.grid_thw}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) both divisible by `factor`, area near [min_pixels, max_pixels], aspect kept.

    Rounding follows transformers exactly (Python's round-half-to-even included).
    """
    if height <= 0 or width <= 0:
        raise MediaError(f"image is {width}x{height}: it has no pixels")
    aspect_ratio = max(height, width) / min(height, width)
    if aspect_ratio > MAX_ASPECT_RATIO:
        raise MediaError(
            f"image is {width}x{height}, aspect ratio {aspect_ratio:.1f}:1; Qwen2-VL accepts at most "
            f"{MAX_ASPECT_RATIO}:1 — crop or pad the image"
        )
    resized_h = round(height / factor) * factor
    resized_w = round(width / factor) * factor
    if resized_h * resized_w > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        resized_h = max(factor, math.floor(height / beta / factor) * factor)
        resized_w = max(factor, math.floor(width / beta / factor) * factor)
    elif resized_h * resized_w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        resized_h = math.ceil(height * beta / factor) * factor
        resized_w = math.ceil(width * beta / factor) * factor
    return resized_h, resized_w


@dataclass(frozen=True)
class Qwen2VLImageProcessor:
    """Effective image processing parameters; every field changes the tensors."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = int(Image.Resampling.BICUBIC)

    @classmethod
    def from_config(cls, preprocessor_config: dict, overrides: dict | None = None) -> "Qwen2VLImageProcessor":
        """Build from a preprocessor_config.json dict; metadata keys it does not use are ignored."""
        config = preprocessor_config
        defaults = cls()
        processor = cls(
            min_pixels=_pixel_bound(config, ("min_pixels", "shortest_edge"), defaults.min_pixels),
            max_pixels=_pixel_bound(config, ("max_pixels", "longest_edge"), defaults.max_pixels),
            patch_size=config.get("patch_size", defaults.patch_size),
            temporal_patch_size=config.get("temporal_patch_size", defaults.temporal_patch_size),
            merge_size=config.get("merge_size", defaults.merge_size),
            image_mean=_per_channel(config.get("image_mean", defaults.image_mean), "image_mean"),
            image_std=_per_channel(config.get("image_std", defaults.image_std), "image_std"),
            rescale_factor=float(config.get("rescale_factor", defaults.rescale_factor)),
            do_resize=bool(config.get("do_resize", True)),
            do_rescale=bool(config.get("do_rescale", True)),
            do_normalize=bool(config.get("do_normalize", True)),
            do_convert_rgb=bool(config.get("do_convert_rgb", True)),
            resample=int(config.get("resample", defaults.resample)),
        )
        processor._validate_config()
        return processor.with_overrides(overrides or {})

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path, overrides: dict | None = None) -> "Qwen2VLImageProcessor":
        config_path = pathlib.Path(path) / "preprocessor_config.json"
        try:
            config = json.loads(config_path.read_text())
        except FileNotFoundError as exc:
            raise CheckpointError(
                f"{config_path} is missing; a Qwen2-VL checkpoint needs its preprocessor_config.json"
            ) from exc
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{config_path} is not valid JSON ({exc})") from exc
        return cls.from_config(config, overrides)

    def to_config_dict(self) -> dict[str, Any]:
        """A preprocessor_config.json body that transformers loads to the same processor."""
        config = dataclasses.asdict(self)
        config["image_mean"] = list(self.image_mean)
        config["image_std"] = list(self.image_std)
        config["size"] = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        config["image_processor_type"] = "Qwen2VLImageProcessor"
        config["processor_class"] = "Qwen2VLProcessor"
        return config

    def with_overrides(self, overrides: dict) -> "Qwen2VLImageProcessor":
        """Apply mm_processor_kwargs (per request or per LLM); unknown keys are an error."""
        unknown = sorted(set(overrides) - set(OVERRIDE_KEYS))
        if unknown:
            raise InvalidRequestError(
                f"unknown mm_processor_kwargs {unknown}; the Qwen2-VL image processor accepts {list(OVERRIDE_KEYS)}"
            )
        for key, value in overrides.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidRequestError(f"mm_processor_kwargs[{key!r}] must be a positive int, got {value!r}")
        processor = dataclasses.replace(self, **overrides)
        if processor.min_pixels > processor.max_pixels:
            raise InvalidRequestError(
                f"min_pixels ({processor.min_pixels}) is larger than max_pixels ({processor.max_pixels}); "
                "lower min_pixels or raise max_pixels"
            )
        return processor

    @property
    def resize_factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image is resized to before patchifying."""
        if self.do_resize:
            return smart_resize(height, width, self.resize_factor, self.min_pixels, self.max_pixels)
        if height % self.resize_factor or width % self.resize_factor:
            raise MediaError(
                f"image is {width}x{height} but do_resize is off, so both sides must be multiples of "
                f"{self.resize_factor}; resize the image or enable do_resize"
            )
        return height, width

    def num_tokens_for_size(self, width: int, height: int) -> int:
        """Visual tokens an image of this size will take, without processing it."""
        resized_h, resized_w = self.resized_size(width, height)
        return (resized_h // self.patch_size) * (resized_w // self.patch_size) // self.merge_size**2

    def tensor_params(self) -> dict[str, Any]:
        """Every parameter that changes the output tensors, for mm_hash."""
        return {"processor": "qwen2_vl_image", **dataclasses.asdict(self)}

    def process(self, image: Image.Image) -> ProcessedImage:
        """Resize, normalize and patchify one decoded image."""
        rgb = self._as_rgb(image)
        resized_h, resized_w = self.resized_size(rgb.width, rgb.height)
        resized = self.resize_frame(rgb, resized_h, resized_w)
        pixels = self.normalize(np.asarray(resized))  # (H, W, C) float32
        pixel_values = self._patchify(torch.from_numpy(pixels))
        grid_thw = (1, resized_h // self.patch_size, resized_w // self.patch_size)
        return ProcessedImage(
            pixel_values=pixel_values,
            grid_thw=grid_thw,
            num_tokens=math.prod(grid_thw) // self.merge_size**2,
            mm_hash=mm_hash(hash_image(rgb), self.tensor_params()),
        )

    def _as_rgb(self, image: Image.Image) -> Image.Image:
        if self.do_convert_rgb:
            return to_rgb(image)
        if image.mode != "RGB":
            raise MediaError(f"image mode is {image.mode!r} and do_convert_rgb is off; pass an RGB image")
        return image

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 (H, W, C) -> float32 (H, W, C), via a 256-entry table per channel.

        The table holds exactly what transformers computes per pixel (float64
        rescale, cast to float32, float32 normalize), so the result is bit-equal.
        """
        levels = np.arange(256, dtype=np.float64)  # (256,)
        table = levels.astype(np.float32)
        if self.do_rescale:
            table = (levels * self.rescale_factor).astype(np.float32)
        table = np.repeat(table[:, None], 3, axis=1)  # (256, C)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, dtype=np.float32)  # (C,)
            std = np.asarray(self.image_std, dtype=np.float32)  # (C,)
            table = (table - mean) / std
        return table[pixels, np.arange(3)]  # (H, W, C)

    def resize_frame(self, image: Image.Image, resized_h: int, resized_w: int) -> Image.Image:
        if (resized_h, resized_w) == (image.height, image.width):
            return image
        return image.resize((resized_w, resized_h), resample=_PIL_RESAMPLE_FILTERS[self.resample])

    def _patchify(self, pixels: torch.Tensor) -> torch.Tensor:
        height, width, channels = pixels.shape
        P, m, T = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // P, width // P
        patches = pixels.view(grid_h // m, m, P, grid_w // m, m, P, channels)
        patches = patches.permute(0, 3, 1, 4, 6, 2, 5)  # (gh/m, gw/m, m, m, C, P, P)
        patches = patches.unsqueeze(5).expand(-1, -1, -1, -1, -1, T, -1, -1)  # (gh/m, gw/m, m, m, C, T, P, P)
        return patches.reshape(grid_h * grid_w, channels * T * P * P)  # (num_patches, C*T*P*P)

    def _validate_config(self) -> None:
        for key in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"preprocessor_config {key} must be a positive int, got {value!r}")
        if self.resample not in _PIL_RESAMPLE_FILTERS:
            raise ConfigError(
                f"preprocessor_config resample={self.resample} is not a Pillow filter; "
                f"use one of {sorted(_PIL_RESAMPLE_FILTERS)}"
            )
        if self.min_pixels > self.max_pixels:
            raise ConfigError(f"preprocessor_config min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}")


def _pixel_bound(config: dict, keys: tuple[str, str], default: int) -> int:
    """Top-level min/max_pixels win over size{shortest,longest}_edge, as in transformers."""
    pixels_key, edge_key = keys
    size = config.get("size") or {}
    for value in (config.get(pixels_key), size.get(edge_key), size.get(pixels_key)):
        if value is not None:
            return value
    return default


def _per_channel(value: float | list[float], key: str) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ConfigError(f"preprocessor_config {key} needs 3 values (R, G, B), got {len(values)}")
    return (values[0], values[1], values[2])


def expand_placeholders(
    token_ids: list[int], items: list[ProcessedImage], image_token_id: int
) -> tuple[list[int], list[MMFeature]]:
    """Images only: `expand_mm_placeholders` with one modality."""
    return expand_mm_placeholders(token_ids, {"image": (image_token_id, items)})


def expand_mm_placeholders(
    token_ids: list[int], items_by_modality: dict[str, tuple[int, list]]
) -> tuple[list[int], list[MMFeature]]:
    """Replace each single placeholder token by `item.num_tokens` copies.

    items_by_modality: modality -> (placeholder token id, processed items in
    the order their placeholders appear). Returns the expanded ids and one
    MMFeature per item, in prompt order, whose range covers exactly its copies.
    """
    queues = {}
    for modality, (token_id, items) in items_by_modality.items():
        count = token_ids.count(token_id)
        if count != len(items):
            raise PlaceholderMismatchError(
                f"the prompt has {count} {modality} placeholder(s) but {len(items)} {modality}(s) were "
                f"passed; the prompt needs one <|{modality}_pad|> per {modality} (LLM.chat() adds them)")
        queues[token_id] = iter(items)
    expanded: list[int] = []
    features: list[MMFeature] = []
    for token_id in token_ids:
        if token_id not in queues:
            expanded.append(token_id)
            continue
        item = next(queues[token_id])
        placeholder = PlaceholderRange(offset=len(expanded), length=item.num_tokens)
        features.append(MMFeature(modality=item.modality, mm_hash=item.mm_hash,
                                  placeholder=placeholder, data=item.feature_data()))
        expanded.extend([token_id] * item.num_tokens)
    return expanded, features
