"""The visual-token plan of one prompt: each item's size (and each video's
sampled frame count) through the family's planner geometry."""
from __future__ import annotations

from foveal.input_processor.media import PromptMedia
from foveal.multimodal.budget import Geometry, ImageItem, ItemPlan, VideoItem, plan_media
from foveal.multimodal.inputs import MMFeature
from foveal.multimodal.media.video import VideoSampling


def plan_prompt_media(media: PromptMedia, geometry: Geometry, sampling: VideoSampling,
                      max_visual_tokens: int | None) -> list[ItemPlan]:
    """Plans for the images, then the videos (the order `media` holds them in)."""
    items = [ImageItem(image.width, image.height, image.detail) for image in media.images]
    items += [VideoItem(info.width, info.height, sampling.num_frames(info.num_frames, info.fps))
              for info in media.video_infos]
    return list(plan_media(items, geometry, max_visual_tokens).items)


def in_prompt_order(features: list[MMFeature], image_plans: list[ItemPlan],
                    video_plans: list[ItemPlan]) -> list[ItemPlan]:
    queues = {"image": iter(image_plans), "video": iter(video_plans)}
    return [next(queues[feature.modality]) for feature in features]
