"""Idefics3 / SmolVLM image processor and placeholder expansion.

Splitting (do_image_splitting, as transformers' Idefics3ImageProcessorPil):
the image is resized (Lanczos) so its longest edge is `longest_edge` (size),
then each side is rounded up to a multiple of the tile side
(max_image_size["longest_edge"], the tower's input) and resized again; if
that is larger than one tile it is cut into rows x cols tiles, and the whole
resized image, downscaled to one tile, follows as the global view. Without
splitting (or when the image fits one tile) it is one tile-sized view.
Pixels are rescaled and normalized (mean = std = 0.5).

In a prompt each image is one <image> token. Expansion writes what
transformers' Idefics3Processor / SmolVLMProcessor write: per tile
"<fake_token_around_image><row_r_col_c>" + <image> x image_seq_len, "\\n"
after each row, then "\\n<fake_token_around_image><global-img>" + <image> x
image_seq_len + "<fake_token_around_image>" (a single view: the same without
the tiles and the "\\n"). The replacement starts and ends with special tokens,
so the text around it tokenizes as it does in transformers. The item's
placeholder runs from its first <image> token to its last; its feature lists
the <image> runs and the token ids in between (the markers).

Planner arithmetic: tokens = views * image_seq_len; min_pixels is one tile's
area, max_pixels the square of the longest edge; a smaller max_pixels (the
budget planner's choice) lowers the resized longest edge to the largest
multiple of the tile side within sqrt(max_pixels), so fewer tiles.
"""
from __future__ import annotations

import dataclasses
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
from foveal.multimodal.inputs import MMFeature, PlaceholderRange
from foveal.multimodal.media.image import to_rgb
from foveal.multimodal.processors.qwen2_vl import Qwen2VLImageProcessor

# mm_processor_kwargs the image processor accepts (max_pixels: the planner's dial)
OVERRIDE_KEYS = ("do_image_splitting", "max_pixels")
_MAX_IMAGE_SIZE = 4096  # transformers' absolute cap on the resized longest edge
# Feature data key: (offset, length) of each <image> run inside the placeholder, one per view.
IMAGE_RUNS_KEY = "image_runs"


@dataclass(frozen=True)
class MarkerTokens:
    """The token strings of the expanded prompt (checkpoints name their own)."""

    image: str = "<image>"
    fake: str = "<fake_token_around_image>"
    global_image: str = "<global-img>"


@dataclass(frozen=True)
class ProcessedIdefics3Image:
    pixel_values: torch.Tensor  # (views, C, S, S) float32: rows x cols tiles, then the global view
    rows: int  # 0 and 0: a single view
    cols: int
    image_seq_len: int
    num_tokens: int  # <image> tokens: views * image_seq_len
    mm_hash: str
    markers: MarkerTokens
    modality = "image"

    def feature_data(self) -> dict[str, Any]:
        return {"pixel_values": self.pixel_values, "rows": self.rows, "cols": self.cols}

    def prompt_text(self) -> str:
        return replacement_text(self.markers, self.rows, self.cols, self.image_seq_len)


def rescaled_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """transformers' longest-edge rule: (height, width) with the longest side = longest_edge,
    the other truncated then made even; both capped at 4096."""
    ratio = width / height
    if width >= height:
        width, height = longest_edge, int(longest_edge / ratio)
        height += height % 2
    else:
        height, width = longest_edge, int(longest_edge * ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    ratio = width / height
    if width >= height and width > _MAX_IMAGE_SIZE:
        width, height = _MAX_IMAGE_SIZE, int(_MAX_IMAGE_SIZE / ratio)
    elif height > width and height > _MAX_IMAGE_SIZE:
        height, width = _MAX_IMAGE_SIZE, int(_MAX_IMAGE_SIZE * ratio)
    return max(height, 1), max(width, 1)


def tile_canvas(height: int, width: int, tile: int) -> tuple[int, int]:
    """Each side rounded up to a multiple of the tile (the longer one first, as transformers)."""
    ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * ratio) / tile) * tile
    return height, width


@dataclass(frozen=True)
class Idefics3ImageProcessor:
    """Effective image processing parameters; every field but `markers` changes the tensors."""

    tile_size: int = 364  # max_image_size["longest_edge"]: the tower's input side
    longest_edge: int = 4 * 364  # size["longest_edge"] (lowered by the planner's max_pixels)
    image_seq_len: int = 169
    do_image_splitting: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = int(Image.Resampling.LANCZOS)
    markers: MarkerTokens = MarkerTokens()
    configured_edge: int = 0  # size["longest_edge"] as configured; 0: longest_edge

    @classmethod
    def from_config(cls, hf_config: dict, preprocessor: dict,
                    overrides: dict | None = None) -> "Idefics3ImageProcessor":
        """config.json + preprocessor_config.json dicts."""
        from foveal.models.idefics3_config import idefics3_model_config

        model = idefics3_model_config(hf_config, None, (), None, None)
        settings = model.family_config
        tile = (preprocessor.get("max_image_size") or {}).get("longest_edge", settings.image_size)
        if tile != settings.image_size:
            raise ConfigError(f"max_image_size {tile} differs from the vision tower's "
                              f"{settings.image_size}px input; preprocessor_config.json and config.json "
                              "disagree")
        edge = (preprocessor.get("size") or {}).get("longest_edge", 4 * tile)
        if edge % tile:
            raise ConfigError(f"size longest_edge {edge} is not a multiple of the {tile}px tile")
        if preprocessor.get("do_resize") is False or preprocessor.get("do_convert_rgb") is False:
            raise ConfigError("Idefics3 processing needs do_resize and do_convert_rgb on")
        values = {key: preprocessor[key] for key in ("do_image_splitting", "rescale_factor", "do_rescale",
                                                     "do_normalize", "resample")
                  if preprocessor.get(key) is not None}
        for key in ("image_mean", "image_std"):
            if preprocessor.get(key) is not None:
                values[key] = tuple(float(v) for v in preprocessor[key])
        keys = (("image", "image_token"), ("fake", "fake_image_token"),
                ("global_image", "global_image_token"))
        names = {name: preprocessor[key] for name, key in keys if preprocessor.get(key)}
        processor = cls(tile_size=tile, longest_edge=edge, configured_edge=edge,
                        image_seq_len=settings.image_seq_len(model.vision.patch_size),
                        markers=MarkerTokens(**names), **values)
        return processor.with_overrides(overrides or {})

    @classmethod
    def from_pretrained(cls, path: str, overrides: dict | None = None) -> "Idefics3ImageProcessor":
        folder = pathlib.Path(path or "")
        return cls.from_config(_read(folder / "config.json"), _read(folder / "preprocessor_config.json"),
                               overrides)

    @property
    def min_pixels(self) -> int:
        return self.tile_size ** 2  # one view

    @property
    def max_pixels(self) -> int:
        return self.longest_edge ** 2 if self.do_image_splitting else self.tile_size ** 2

    def with_overrides(self, overrides: dict) -> "Idefics3ImageProcessor":
        """mm_processor_kwargs; {"max_pixels": n} lowers the longest edge to a multiple of the tile."""
        unknown = sorted(set(overrides) - set(OVERRIDE_KEYS))
        if unknown:
            raise InvalidRequestError(f"unknown mm_processor_kwargs {unknown}; the Idefics3 image "
                                      f"processor accepts {list(OVERRIDE_KEYS)}")
        values = dict(overrides)
        if "do_image_splitting" in values and not isinstance(values["do_image_splitting"], bool):
            raise InvalidRequestError("mm_processor_kwargs['do_image_splitting'] must be true or false, "
                                      f"got {values['do_image_splitting']!r}")
        splitting = values.get("do_image_splitting", self.do_image_splitting)
        if "max_pixels" in values:
            max_pixels = values.pop("max_pixels")
            valid = isinstance(max_pixels, int) and not isinstance(max_pixels, bool)
            if not valid or max_pixels < self.min_pixels:
                raise InvalidRequestError(f"max_pixels {max_pixels!r} is below one Idefics3 tile "
                                          f"({self.tile_size}x{self.tile_size} = {self.min_pixels})")
            if splitting:  # one view either way without splitting
                tiles = math.isqrt(max_pixels) // self.tile_size
                values["longest_edge"] = min(self.configured_edge or self.longest_edge,
                                             tiles * self.tile_size)
        return dataclasses.replace(self, **values)

    def grid(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(rows, cols, resized height, resized width) of a width x height image; rows = cols = 0:
        a single view."""
        if not self.do_image_splitting:
            return 0, 0, self.tile_size, self.tile_size
        resized_h, resized_w = rescaled_size(height, width, self.longest_edge)
        canvas_h, canvas_w = tile_canvas(resized_h, resized_w, self.tile_size)
        if canvas_h > self.tile_size or canvas_w > self.tile_size:
            return canvas_h // self.tile_size, canvas_w // self.tile_size, canvas_h, canvas_w
        return 0, 0, canvas_h, canvas_w

    def num_tokens_for_size(self, width: int, height: int) -> int:
        rows, cols, _, _ = self.grid(width, height)
        return self.image_seq_len * (rows * cols + 1 if rows else 1)

    def tensor_params(self) -> dict[str, Any]:
        """Every parameter that can change the tensors (the processor cache's key)."""
        params = dataclasses.asdict(self)
        del params["markers"], params["configured_edge"]
        return {"processor": "idefics3_image", **params}

    def process(self, image: Image.Image) -> ProcessedIdefics3Image:
        rgb = to_rgb(image)
        rows, cols, height, width = self.grid(rgb.width, rgb.height)
        tile, resample = self.tile_size, Image.Resampling(self.resample)
        resized_h, resized_w = rescaled_size(rgb.height, rgb.width, self.longest_edge)
        # transformers resizes to the longest edge first, with or without splitting
        canvas = rgb.resize((resized_w, resized_h), resample).resize((width, height), resample)
        pixels = np.asarray(canvas)  # (H, W, C) uint8
        views = [pixels[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]
                 for r in range(rows) for c in range(cols)]
        views.append(np.asarray(canvas.resize((tile, tile), resample)) if rows else pixels)
        normalized = np.stack([Qwen2VLImageProcessor.normalize(self, view) for view in views])
        pixel_values = torch.from_numpy(normalized).permute(0, 3, 1, 2).contiguous()  # (V, C, S, S)
        params = {**self.tensor_params(), "grid": [rows, cols, height, width]}
        return ProcessedIdefics3Image(pixel_values, rows, cols, self.image_seq_len,
                                      self.image_seq_len * len(views), mm_hash(hash_image(rgb), params),
                                      self.markers)


def _read(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing; an Idefics3 / SmolVLM checkpoint needs it") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from exc


def replacement_text(markers: MarkerTokens, rows: int, cols: int, image_seq_len: int) -> str:
    """What transformers' Idefics3Processor writes for one image."""
    run = markers.image * image_seq_len
    single = f"{markers.fake}{markers.global_image}{run}{markers.fake}"
    if rows == 0 and cols == 0:
        return single
    tiles = "".join("".join(f"{markers.fake}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
                    for r in range(rows))
    return f"{tiles}\n{single}"


def idefics3_expander(tokenizer) -> Callable:
    """The placeholder expansion with this tokenizer (see the module docstring; SmolVLM
    videos: smolvlm_video.py)."""

    def expand(token_ids: list[int], items_by_modality: dict[str, tuple[int, list]]
               ) -> tuple[list[int], list[MMFeature]]:
        queues = {}
        for modality, name in (("image", "<image>"), ("video", "<video>")):
            token_id, items = items_by_modality.get(modality, (-1, []))
            count = token_ids.count(token_id) if items else 0
            if count != len(items):
                raise PlaceholderMismatchError(
                    f"the prompt has {count} {name} placeholder(s) but {len(items)} {modality}(s) "
                    f"were passed; the prompt needs one {name} per {modality} (LLM.chat() adds them)")
            if items:
                queues[token_id] = iter(items)
        expanded, features = [], []
        image_id = items_by_modality.get("image", (-1, []))[0]
        for token_id in token_ids:
            if token_id not in queues:
                expanded.append(token_id)
                continue
            item = next(queues[token_id])
            replacement = tokenizer.encode(item.prompt_text())
            if replacement.count(image_id) != item.num_tokens:
                raise ConfigError(f"the tokenizer does not encode {item.markers.image!r} as the image "
                                  f"token {image_id}; the checkpoint's tokenizer and config disagree")
            features.append(_feature(item, replacement, len(expanded), image_id))
            expanded += replacement
        return expanded, features

    return expand


def _feature(item, replacement: list[int], offset: int, image_id: int) -> MMFeature:
    """The item's feature (an image's views, or a video's frames): placeholder from its
    first <image> token to its last."""
    first = replacement.index(image_id)
    last = len(replacement) - 1 - replacement[::-1].index(image_id)
    span = replacement[first:last + 1]
    runs, index = [], 0
    while index < len(span):
        end = index
        while end < len(span) and span[end] == image_id:
            end += 1
        if end > index:
            runs.append((index, end - index))
        index = max(end, index + 1)
    data = {**item.feature_data(), IMAGE_RUNS_KEY: tuple(runs), "token_ids": tuple(span)}
    return MMFeature(item.modality, item.mm_hash, PlaceholderRange(offset + first, len(span)), data)
