"""Gemma 3 image processor and placeholder expansion.

An image becomes image_size x image_size views: the whole image, and with
pan-and-scan (do_pan_and_scan) also up to pan_and_scan_max_num_crops crops
along its longer side when its aspect ratio reaches
pan_and_scan_min_ratio_to_activate. Each view is resized with Pillow
(bilinear), rescaled and normalized (mean = std = 0.5) like transformers'
`Gemma3ImageProcessorPil`, and fills mm_tokens_per_image tokens.

In a prompt each image is one <start_of_image> token. Expansion replaces it
with what transformers' Gemma3Processor writes: "\\n\\n<start_of_image>" +
image tokens + "<end_of_image>\\n\\n", and with crops "Here is the original
image ... and here are some crops to help you see better ..." around one such
sequence per view. The text next to a replacement is tokenized again with the
prompt text it touches (so "\\n" + "\\n\\n" becomes one newline token where the
tokenizer has one, as transformers tokenizes the expanded text). The item's
placeholder runs from its first image token to its last; its feature lists
the image-token runs (bidirectional attention) and the token ids in between.

Planner arithmetic: min_pixels is one view's area, max_pixels the whole image
plus every crop; a smaller max_pixels (the budget planner's choice) caps the
crop count at max_pixels // view area - 1 (fewer than 2 crops: none).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from foveal.errors import CheckpointError, ConfigError, InvalidRequestError, PlaceholderMismatchError
from foveal.multimodal.hashing import hash_image, mm_hash
from foveal.multimodal.inputs import BIDIRECTIONAL_KEY, MMFeature, PlaceholderRange
from foveal.multimodal.media.image import to_rgb
from foveal.multimodal.processors.qwen2_vl import Qwen2VLImageProcessor

PAN_AND_SCAN_KEYS = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                     "pan_and_scan_min_ratio_to_activate")
# mm_processor_kwargs the image processor accepts (max_pixels: the planner's crop cap)
OVERRIDE_KEYS = (*PAN_AND_SCAN_KEYS, "max_pixels")


@dataclass(frozen=True)
class Gemma3Tokens:
    boi: int  # <start_of_image>: the prompt's placeholder, one per image
    eoi: int  # <end_of_image>
    image: int  # the image soft token, mm_tokens_per_image per view


@dataclass(frozen=True)
class ProcessedGemma3Image:
    pixel_values: torch.Tensor  # (1 + num_crops, C, S, S) float32: the image, then its crops
    num_crops: int
    num_tokens: int  # image tokens: mm_tokens_per_image * (1 + num_crops)
    mm_hash: str
    tokens: Gemma3Tokens
    modality = "image"

    def feature_data(self) -> dict[str, Any]:
        return {"pixel_values": self.pixel_values, "num_crops": self.num_crops}


def num_pan_and_scan_crops(width: int, height: int, min_crop_size: int, max_num_crops: int,
                           min_ratio: float) -> tuple[int, int]:
    """(crops across, crops down), (0, 0) for none: transformers' pan_and_scan rule."""
    long_side, short_side = max(width, height), min(width, height)
    if long_side / short_side < min_ratio:
        return 0, 0
    count = int(math.floor(long_side / short_side + 0.5))  # half rounds up
    count = min(int(math.floor(long_side / min_crop_size)), count)
    count = min(max_num_crops, max(2, count))
    across, down = (count, 1) if width >= height else (1, count)
    if min(math.ceil(width / across), math.ceil(height / down)) < min_crop_size:
        return 0, 0
    return across, down


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    """Effective image processing parameters; every field changes the tensors."""

    image_size: int = 896
    tokens_per_image: int = 256
    tokens: Gemma3Tokens = Gemma3Tokens(255_999, 256_000, 262_144)
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = int(Image.Resampling.BILINEAR)
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2
    crop_cap: int | None = None  # the planner's cap on crops (from max_pixels); None: none

    @classmethod
    def from_config(cls, hf_config: dict, preprocessor: dict,
                    overrides: dict | None = None) -> "Gemma3ImageProcessor":
        """config.json + preprocessor_config.json dicts (null entries take the defaults)."""
        from foveal.models.gemma3_config import gemma3_model_config

        settings = gemma3_model_config(hf_config, None, (), None, None).family_config
        size = preprocessor.get("size") or {}
        side = size.get("height", settings.image_size) if isinstance(size, dict) else size
        if side != settings.image_size or size.get("width", side) != side:
            raise ConfigError(f"preprocessor_config size {size} differs from the vision tower's "
                              f"{settings.image_size}x{settings.image_size} input")
        if preprocessor.get("do_resize") is False:
            raise ConfigError("Gemma 3 processing needs do_resize on: the tower takes fixed-size views")
        known = {field.name for field in dataclasses.fields(cls)}
        values = {key: value for key, value in preprocessor.items()
                  if key in known and value is not None and key not in ("image_size", "tokens")}
        for key in ("image_mean", "image_std"):
            if key in values:
                values[key] = tuple(float(v) for v in values[key])
        model = hf_config
        processor = cls(image_size=settings.image_size, tokens_per_image=settings.mm_tokens_per_image,
                        tokens=Gemma3Tokens(settings.boi_token_id, settings.eoi_token_id,
                                            model.get("image_token_index", model.get("image_token_id"))),
                        **values)
        return processor.with_overrides(overrides or {})

    @classmethod
    def from_pretrained(cls, path: str, overrides: dict | None = None) -> "Gemma3ImageProcessor":
        folder = pathlib.Path(path or "")
        return cls.from_config(_read(folder / "config.json"), _read(folder / "preprocessor_config.json"),
                               overrides)

    @property
    def min_pixels(self) -> int:
        return self.image_size ** 2  # one view

    @property
    def max_pixels(self) -> int:
        crops = self.max_crops
        return self.image_size ** 2 * (1 + crops)

    @property
    def max_crops(self) -> int:
        if not self.do_pan_and_scan:
            return 0
        cap = self.pan_and_scan_max_num_crops if self.crop_cap is None else self.crop_cap
        return min(self.pan_and_scan_max_num_crops, cap)

    def with_overrides(self, overrides: dict) -> "Gemma3ImageProcessor":
        """mm_processor_kwargs; {"max_pixels": n} caps the crops at n // view area - 1."""
        unknown = sorted(set(overrides) - set(OVERRIDE_KEYS))
        if unknown:
            raise InvalidRequestError(f"unknown mm_processor_kwargs {unknown}; the Gemma 3 image "
                                      f"processor accepts {list(OVERRIDE_KEYS)}")
        values = dict(overrides)
        for key, value in values.items():
            _check_override(key, value)
        if "max_pixels" in values:
            max_pixels = values.pop("max_pixels")
            if max_pixels < self.min_pixels:
                raise InvalidRequestError(f"max_pixels {max_pixels} is below one Gemma 3 view "
                                          f"({self.image_size}x{self.image_size} = {self.min_pixels})")
            values["crop_cap"] = max_pixels // self.min_pixels - 1
        return dataclasses.replace(self, **values)

    def num_crops(self, width: int, height: int) -> tuple[int, int]:
        """(across, down) crops of a width x height image; (0, 0) for none."""
        limit = self.max_crops
        if limit == 0 or (limit < 2 and self.crop_cap is not None):
            return 0, 0
        return num_pan_and_scan_crops(width, height, self.pan_and_scan_min_crop_size, limit,
                                      self.pan_and_scan_min_ratio_to_activate)

    def num_tokens_for_size(self, width: int, height: int) -> int:
        across, down = self.num_crops(width, height)
        return self.tokens_per_image * (1 + across * down)

    def tensor_params(self) -> dict[str, Any]:
        """Every parameter that can change the tensors (the processor cache's key)."""
        params = dataclasses.asdict(self)
        params["crops_allowed"] = self.max_crops
        del params["crop_cap"], params["tokens"]
        return {"processor": "gemma3_image", **params}

    def _view_params(self, across: int, down: int) -> dict[str, Any]:
        """What made one image's tensors: the view processing and its crop grid (mm_hash),
        so an image pan-and-scan leaves whole keeps its hash."""
        params = {key: value for key, value in self.tensor_params().items()
                  if key not in PAN_AND_SCAN_KEYS and key != "crops_allowed"}
        return {**params, "crops": [across, down]}

    def process(self, image: Image.Image) -> ProcessedGemma3Image:
        rgb = to_rgb(image)
        across, down = self.num_crops(rgb.width, rgb.height)
        views = [rgb] + _crops(rgb, across, down)
        side = self.image_size
        pixels = [Qwen2VLImageProcessor.normalize(self, np.asarray(_resized(view, side, self.resample)))
                  for view in views]  # (S, S, C) float32 each
        pixel_values = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).contiguous()
        return ProcessedGemma3Image(pixel_values, len(views) - 1,
                                    self.tokens_per_image * len(views),
                                    mm_hash(hash_image(rgb), self._view_params(across, down)),
                                    self.tokens)


def _check_override(key: str, value: Any) -> None:
    if key == "do_pan_and_scan":
        ok, kind = isinstance(value, bool), "true or false"
    elif key == "pan_and_scan_min_ratio_to_activate":
        ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, \
            "a positive number"
    else:
        ok, kind = isinstance(value, int) and not isinstance(value, bool) and value > 0, "a positive int"
    if not ok:
        raise InvalidRequestError(f"mm_processor_kwargs[{key!r}] must be {kind}, got {value!r}")


def _crops(image: Image.Image, across: int, down: int) -> list[Image.Image]:
    """Crops on a grid of ceil-sized cells; the last row / column may be smaller (as numpy slices)."""
    if across * down == 0:
        return []
    pixels = np.asarray(image)
    width, height = math.ceil(image.width / across), math.ceil(image.height / down)
    return [Image.fromarray(pixels[top:top + height, left:left + width])
            for top, left in itertools.product(range(0, height * down, height),
                                               range(0, width * across, width))]


def _resized(image: Image.Image, side: int, resample: int) -> Image.Image:
    if image.size == (side, side):
        return image
    return image.resize((side, side), resample=Image.Resampling(resample))


def _read(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing; a Gemma 3 checkpoint needs it") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from exc


def replacement_text(tokens: dict[str, str], tokens_per_image: int, num_crops: int) -> str:
    """What transformers' Gemma3Processor writes for one image (token strings by name)."""
    view = f"\n\n{tokens['boi']}{tokens['image'] * tokens_per_image}{tokens['eoi']}\n\n"
    if not num_crops:
        return view
    return (f"Here is the original image {view} and here are some crops to help you see better "
            + " ".join([view] * num_crops))


def gemma3_expander(tokenizer) -> Callable:
    """The placeholder expansion with this tokenizer (see the module docstring)."""
    all_special = set(tokenizer.all_special_ids)

    def retokenized(ids: list[int]) -> list[int]:
        return tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=False)) if ids else []

    def expand(token_ids: list[int], items_by_modality: dict[str, tuple[int, list]]
               ) -> tuple[list[int], list[MMFeature]]:
        if items_by_modality.get("video", (0, []))[1]:
            raise InvalidRequestError("Gemma 3 takes images only; send video frames as images")
        items = items_by_modality.get("image", (0, []))[1]
        tokens = items[0].tokens if items else None
        special = all_special | ({tokens.boi, tokens.eoi, tokens.image} if tokens else set())
        count = token_ids.count(tokens.boi) if tokens else 0
        if count != len(items):
            raise PlaceholderMismatchError(
                f"the prompt has {count} <start_of_image> placeholder(s) but {len(items)} image(s) "
                "were passed; the prompt needs one <start_of_image> per image (LLM.chat() adds them)")
        names = {} if tokens is None else {name: tokenizer.id_to_token(getattr(tokens, name))
                                           for name in ("boi", "eoi", "image")}
        queue, expanded, features, text_from = iter(items), [], [], None
        for token_id in [*token_ids, None]:
            if token_id is not None and token_id not in special:
                expanded.append(token_id)
                continue
            if text_from is not None:  # the text after a replacement, tokenized with it
                expanded[text_from:] = retokenized(expanded[text_from:])
                text_from = None
            if token_id is None:
                break
            if tokens is None or token_id != tokens.boi:
                expanded.append(token_id)
                continue
            item = next(queue)
            replacement = tokenizer.encode(replacement_text(names, item.num_tokens // (1 + item.num_crops),
                                                            item.num_crops))
            lead = next(i for i, t in enumerate(replacement) if t in special)  # text before it
            start = len(expanded)
            while start > 0 and expanded[start - 1] not in special:
                start -= 1
            expanded[start:] = retokenized(expanded[start:] + replacement[:lead])
            offset = len(expanded)
            expanded += replacement[lead:]
            text_from = len(expanded) - _trailing_text(replacement, special)
            features.append(_feature(item, expanded, offset, tokens.image))
        return expanded, features

    return expand


def _trailing_text(ids: list[int], special: set[int]) -> int:
    count = 0
    while count < len(ids) and ids[-1 - count] not in special:
        count += 1
    return count


def _feature(item: ProcessedGemma3Image, expanded: list[int], start: int, image_id: int) -> MMFeature:
    """The item's feature: placeholder from its first image token to its last."""
    first = expanded.index(image_id, start)
    last = len(expanded) - 1 - expanded[::-1].index(image_id)
    span = expanded[first:last + 1]
    runs, index = [], 0
    while index < len(span):
        if span[index] == image_id:
            end = index
            while end < len(span) and span[end] == image_id:
                end += 1
            runs.append((index, end - index))
            index = end
        else:
            index += 1
    data = {**item.feature_data(), BIDIRECTIONAL_KEY: tuple(runs), "token_ids": tuple(span)}
    return MMFeature("image", item.mm_hash, PlaceholderRange(first, len(span)), data)
