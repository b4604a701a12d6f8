"""The Qwen3-VL family as a `ProcessorFamily`: its processors, their
mm_processor_kwargs, placeholder expansion (video timestamps rendered with the
tokenizer), the planner's geometry (32 pixels per visual token), and the
files a tiny offline checkpoint ships (processor configs, chat template)."""
from __future__ import annotations

from dataclasses import dataclass

from foveal.loader.chat_templates import QWEN2_VL_CHAT_TEMPLATE
from foveal.multimodal.budget import Geometry
from foveal.multimodal.processors.family import ProcessorFamily
from foveal.multimodal.processors.qwen2_vl import OVERRIDE_KEYS as IMAGE_KEYS
from foveal.multimodal.processors.qwen2_vl_family import vision_span_ids
from foveal.multimodal.processors.qwen2_vl_video import OVERRIDE_KEYS as VIDEO_KEYS
from foveal.multimodal.processors.qwen3_vl import (Qwen3VLImageProcessor, Qwen3VLVideoProcessor,
                                                   capped_clip_size, expand_without_tokenizer,
                                                   qwen3_vl_expander)

# Tiny checkpoints cap resolution so tests stay fast (<= 64 image tokens).
TINY_IMAGE_MIN_PIXELS = 4 * 32 * 32
TINY_IMAGE_MAX_PIXELS = 256 * 256
TINY_VIDEO_MAX_PIXELS = 4 * 128 * 128  # over a whole clip


@dataclass(frozen=True)
class Qwen3VLGeometry(Geometry):
    """Video pixel bounds cover the whole clip (see qwen3_vl): the planner's
    per-frame level caps each frame, as `Qwen3VLVideoProcessor.with_max_pixels`."""

    def video_tokens(self, width: int, height: int, num_frames: int, min_pixels: int,
                     max_pixels: int) -> int:
        T, factor = self.temporal_patch_size, self.factor
        resized_h, resized_w = capped_clip_size(num_frames, width, height, T, factor,
                                                self.video_min_pixels, self.video_max_pixels, max_pixels)
        return (resized_h // factor) * (resized_w // factor) * -(-num_frames // T)


def planner_geometry(image_processor: Qwen3VLImageProcessor,
                     video_processor: Qwen3VLVideoProcessor) -> Geometry:
    frame = video_processor.frame
    return Qwen3VLGeometry(
        patch_size=frame.patch_size, merge_size=frame.merge_size,
        temporal_patch_size=frame.temporal_patch_size,
        image_min_pixels=image_processor.min_pixels, image_max_pixels=image_processor.max_pixels,
        video_min_pixels=frame.min_pixels, video_max_pixels=frame.max_pixels,
        min_frames=video_processor.min_frames)


QWEN3_VL = ProcessorFamily(
    name="qwen3_vl",
    image_processor_class=Qwen3VLImageProcessor,
    video_processor_class=Qwen3VLVideoProcessor,
    image_override_keys=tuple(IMAGE_KEYS),
    video_override_keys=tuple(VIDEO_KEYS),
    expand_placeholders=expand_without_tokenizer,  # images only: videos need the tokenizer
    planner_geometry=planner_geometry,
    text_expander=qwen3_vl_expander,
    image_prompt_ids=vision_span_ids,
)


def tiny_processor_configs(tiny: bool) -> dict[str, dict]:
    """file name -> body of the processor configs a checkpoint folder ships."""
    image = (Qwen3VLImageProcessor(min_pixels=TINY_IMAGE_MIN_PIXELS, max_pixels=TINY_IMAGE_MAX_PIXELS)
             if tiny else Qwen3VLImageProcessor())
    video = {**Qwen3VLImageProcessor().to_config_dict(), "min_pixels": 4 * 32 * 32,
             "max_pixels": TINY_VIDEO_MAX_PIXELS if tiny else 768 * 32 * 32,
             "fps": 2.0, "min_frames": 4, "max_frames": 768,
             "video_processor_type": "Qwen3VLVideoProcessor"}
    video["size"] = {"shortest_edge": video["min_pixels"], "longest_edge": video["max_pixels"]}
    return {"preprocessor_config.json": image.to_config_dict(),
            "video_preprocessor_config.json": video}


# Qwen3-VL-*-Instruct's template, without tool calls and reasoning: no default
# system message; media parts render as <|vision_start|><|image_pad|> (or
# <|video_pad|>)<|vision_end|>.
_QWEN2_DEFAULT_SYSTEM = ("{% if loop.first and message['role'] != 'system' %}"
                         "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}")
assert _QWEN2_DEFAULT_SYSTEM in QWEN2_VL_CHAT_TEMPLATE
QWEN3_VL_CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE.replace(_QWEN2_DEFAULT_SYSTEM, "")
