"""The Qwen2-VL family (Qwen2-VL and Qwen2.5-VL process media alike) as a
`ProcessorFamily`: its processors, their mm_processor_kwargs, placeholder
expansion and the planner's geometry."""
from __future__ import annotations

from foveal.multimodal.budget import Geometry
from foveal.multimodal.processors.family import ProcessorFamily
from foveal.multimodal.processors.qwen2_vl import OVERRIDE_KEYS as IMAGE_KEYS
from foveal.multimodal.processors.qwen2_vl import Qwen2VLImageProcessor, expand_mm_placeholders
from foveal.multimodal.processors.qwen2_vl_video import OVERRIDE_KEYS as VIDEO_KEYS
from foveal.multimodal.processors.qwen2_vl_video import Qwen2VLVideoProcessor


def vision_span_ids(model_config) -> tuple[int, ...]:
    """<|vision_start|><|image_pad|><|vision_end|>: one image in a Qwen-VL prompt."""
    return (model_config.vision_start_token_id, model_config.image_token_id,
            model_config.vision_end_token_id)


def planner_geometry(image_processor: Qwen2VLImageProcessor,
                     video_processor: Qwen2VLVideoProcessor) -> Geometry:
    frame = video_processor.frame
    return Geometry(
        patch_size=frame.patch_size, merge_size=frame.merge_size,
        temporal_patch_size=frame.temporal_patch_size,
        image_min_pixels=image_processor.min_pixels, image_max_pixels=image_processor.max_pixels,
        video_min_pixels=frame.min_pixels, video_max_pixels=frame.max_pixels,
        min_frames=video_processor.min_frames)


QWEN2_VL = ProcessorFamily(
    name="qwen2_vl",
    image_processor_class=Qwen2VLImageProcessor,
    video_processor_class=Qwen2VLVideoProcessor,
    image_override_keys=tuple(IMAGE_KEYS),
    video_override_keys=tuple(VIDEO_KEYS),
    expand_placeholders=expand_mm_placeholders,
    planner_geometry=planner_geometry,
    image_prompt_ids=vision_span_ids,
)
