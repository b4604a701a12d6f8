"""The LLaVA family (1.5, NeXT, OneVision) as a `ProcessorFamily`.

The image processor is built from the checkpoint's preprocessor_config.json
and config.json together: the token arithmetic needs the tower's patch size,
the feature select strategy and the anyres canvases. Placeholders expand like
Qwen2-VL's (the image / video token repeated once per visual token). Videos:
LLaVA-OneVision only (llava_video.py); the other variants refuse them clearly.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

from foveal.errors import CheckpointError, ConfigError
from foveal.multimodal.budget import Geometry
from foveal.multimodal.processors.family import ProcessorFamily
from foveal.multimodal.processors.llava import (OVERRIDE_KEYS, LlavaImageProcessor,
                                                select_best_resolution)
from foveal.multimodal.processors.llava_video import OVERRIDE_KEYS as VIDEO_KEYS
from foveal.multimodal.processors.llava_video import LlavaVideoProcessor
from foveal.multimodal.processors.qwen2_vl import expand_mm_placeholders


def _read(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing; a LLaVA checkpoint needs it") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from exc


def _side(value: Any, key: str) -> int | None:
    """An int size or a {"height", "width"} / {"shortest_edge"} dict -> one side."""
    if value is None or isinstance(value, int):
        return value
    if "height" in value and value["height"] != value.get("width"):
        raise ConfigError(f"preprocessor_config {key} {value} is not square; LLaVA tiles are square")
    return value.get("height", value.get("shortest_edge"))


def processor_from_config(hf_config: dict, preprocessor: dict,
                          overrides: dict | None = None) -> LlavaImageProcessor:
    """config.json + preprocessor_config.json dicts -> the image processor."""
    from foveal.models.llava_config import llava_model_config

    model = llava_model_config(hf_config, None, (), None, None)
    settings, vision = model.family_config, model.vision
    side = settings.image_size // vision.patch_size
    has_cls = vision.variant == "clip"
    base_tokens = side ** 2 + int(has_cls) - int(settings.select_strategy == "default")
    anyres = settings.variant != "llava"
    size, crop = _side(preprocessor.get("size"), "size"), _side(preprocessor.get("crop_size"), "crop_size")
    tile = (size if settings.variant == "llava_onevision" else crop) or settings.image_size
    if tile != settings.image_size:
        raise ConfigError(f"the processor makes {tile}px views but the vision tower takes "
                          f"{settings.image_size}px; preprocessor_config.json and config.json disagree")
    pinpoints = settings.grid_pinpoints
    own = preprocessor.get("image_grid_pinpoints")
    if anyres and own and tuple(tuple(p) for p in own) != pinpoints:
        raise ConfigError("image_grid_pinpoints differ between preprocessor_config.json and config.json")
    if anyres and (base_tokens != side ** 2 or any(h % tile or w % tile for h, w in pinpoints)):
        raise ConfigError(f"anyres needs {side ** 2} rows per view (strategy "
                          f"{settings.select_strategy!r} gives {base_tokens}) and canvases that are "
                          f"multiples of {tile}px")
    processor = LlavaImageProcessor(
        variant=settings.variant, tile_size=tile, shortest_edge=size or tile, base_tokens=base_tokens,
        feature_side=side, grid_pinpoints=pinpoints, max_tiles=settings.max_tiles,
        max_pixels=max(h * w for h, w in pinpoints) if anyres else tile * tile,
        image_mean=tuple(preprocessor.get("image_mean", LlavaImageProcessor.image_mean)),
        image_std=tuple(preprocessor.get("image_std", LlavaImageProcessor.image_std)),
        rescale_factor=float(preprocessor.get("rescale_factor", 1 / 255)),
        do_rescale=bool(preprocessor.get("do_rescale", True)),
        do_normalize=bool(preprocessor.get("do_normalize", True)),
        resample=int(preprocessor.get("resample", 3)))
    if not (preprocessor.get("do_resize", True) and preprocessor.get("do_convert_rgb", True)):
        raise ConfigError("LLaVA processing needs do_resize and do_convert_rgb on")
    return processor.with_overrides(overrides or {})


def processor_from_checkpoint(path: str, overrides: dict | None = None) -> LlavaImageProcessor:
    folder = pathlib.Path(path or "")
    return processor_from_config(_read(folder / "config.json"), _read(folder / "preprocessor_config.json"),
                                 overrides)


@dataclass(frozen=True)
class LlavaGeometry(Geometry):
    """The planner's token arithmetic through the processor's own (fixed view or anyres canvases)."""

    processor: LlavaImageProcessor | None = None
    video_processor: LlavaVideoProcessor | None = None

    def video_tokens(self, width: int, height: int, num_frames: int, min_pixels: int,
                     max_pixels: int) -> int:
        video = self.video_processor
        return video.num_tokens(num_frames) if video is not None and video.frame else 0

    def frame_tokens(self, width: int, height: int, min_pixels: int, max_pixels: int) -> int:
        if max(width, height) <= 0:
            return 0
        return self._at(max_pixels).num_tokens_for_size(width, height)

    def resized_size(self, width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        processor = self._at(max_pixels)
        if not processor.anyres:
            return processor.tile_size, processor.tile_size
        return select_best_resolution(height, width, processor.canvases())

    def _at(self, max_pixels: int) -> LlavaImageProcessor:
        processor = self.processor
        if processor.anyres:  # the planner's pixel levels sit between canvas areas
            max_pixels = max(processor.min_pixels, max_pixels)
            return processor.with_overrides({"max_pixels": max_pixels})
        return processor


def planner_geometry(image_processor: LlavaImageProcessor,
                     video_processor: LlavaVideoProcessor | None) -> LlavaGeometry:
    # patch_size: pixels per token side, so "low" detail (a quarter of the tokens' area) maps to
    # a quarter of the pixels. Video frames have one size: the planner drops frames only.
    patch = image_processor.tile_size // image_processor.feature_side
    frame_area = image_processor.tile_size ** 2
    return LlavaGeometry(patch_size=patch, merge_size=1, temporal_patch_size=1,
                         image_min_pixels=image_processor.min_pixels,
                         image_max_pixels=image_processor.max_pixels,
                         video_min_pixels=frame_area, video_max_pixels=frame_area,
                         min_frames=video_processor.min_frames if video_processor else 1,
                         processor=image_processor, video_processor=video_processor)


# LLaVA-1.5's "USER: <image>\n... ASSISTANT:" layout, the image token being the tiny
# tokenizer's <|image_pad|>: the template of Foveal's tiny / dummy LLaVA checkpoints.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|image_pad|>\n"
    "{% elif content['type'] == 'video' or 'video' in content %}<|video_pad|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] != 'user' %}<|im_end|>{% endif %} "
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def write_checkpoint_files(folder: pathlib.Path, hf_config: dict) -> None:
    """preprocessor_config.json (transformers' processor of the variant) and the chat template
    of a tiny / dummy LLaVA checkpoint written by foveal.loader.tiny_model."""
    side = (hf_config.get("vision_config") or {}).get("image_size", 336)
    preprocessor = {"image_mean": list(LlavaImageProcessor.image_mean), "do_convert_rgb": True,
                    "image_std": list(LlavaImageProcessor.image_std), "resample": 3,
                    "rescale_factor": 1 / 255, "do_rescale": True, "do_normalize": True, "do_resize": True}
    if hf_config["model_type"] == "llava_onevision":
        preprocessor.update(size={"height": side, "width": side}, do_pad=True,
                            image_grid_pinpoints=hf_config["image_grid_pinpoints"],
                            image_processor_type="LlavaOnevisionImageProcessor")
    else:
        preprocessor.update(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                            do_center_crop=True, image_processor_type="CLIPImageProcessor")
        if hf_config["model_type"] == "llava_next":
            preprocessor.update(image_grid_pinpoints=hf_config["image_grid_pinpoints"], do_pad=True,
                                image_processor_type="LlavaNextImageProcessor")
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2, sort_keys=True))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAVA_CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (folder / "chat_template.jinja").write_text(LLAVA_CHAT_TEMPLATE, encoding="utf-8")


LLAVA = ProcessorFamily(
    name="llava",
    image_processor_class=LlavaImageProcessor,
    video_processor_class=LlavaVideoProcessor,
    image_override_keys=OVERRIDE_KEYS,
    video_override_keys=tuple(VIDEO_KEYS),
    expand_placeholders=expand_mm_placeholders,
    planner_geometry=planner_geometry,
    prompt_image_processor=lambda processor, num_images: processor.in_prompt_of(num_images),
)
