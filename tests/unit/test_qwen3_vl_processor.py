"""Qwen3-VL media processing equals transformers' where it runs here: images
(Qwen2VLImageProcessorPil with Qwen3-VL's numbers), the clip-wide video
resize, video patch order, frame-patch timestamps and the prompt text the
processor renders; plus the planner's 32-pixels-per-token arithmetic."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from foveal.errors import ConfigError
from foveal.multimodal.budget import ImageItem, VideoItem, plan_media
from foveal.multimodal.media.video import load_video, probe_video
from foveal.multimodal.processors import get_processor_family
from foveal.multimodal.processors.qwen3_vl import (Qwen3VLImageProcessor, Qwen3VLVideoProcessor,
                                                   clip_smart_resize, patch_times, timestamp_text)
from foveal.tokenizer import Tokenizer

IMAGE_PAD, VIDEO_PAD, START, END = 12, 13, 9, 10


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    from foveal.loader.tiny_tokenizer import write_tiny_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(folder)
    return Tokenizer.from_pretrained(folder)


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("size", [(100, 70), (64, 200), (33, 517), (640, 480)])
def test_image_processing_equals_transformers(size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ours = Qwen3VLImageProcessor(min_pixels=32 * 32 * 4, max_pixels=256 * 256)
    theirs = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                      image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                      min_pixels=32 * 32 * 4, max_pixels=256 * 256)
    image = _image(*size, seed=sum(size))
    item = ours.process(image)
    reference = theirs(images=[image], return_tensors="pt")
    assert item.grid_thw == tuple(reference["image_grid_thw"][0].tolist())
    assert torch.equal(item.pixel_values, reference["pixel_values"].float())
    assert item.num_tokens == ours.num_tokens_for_size(*size) == item.pixel_values.shape[0] // 4


def test_default_image_processor_has_qwen3_vl_numbers():
    processor = Qwen3VLImageProcessor.from_config({})
    assert (processor.patch_size, processor.image_mean, processor.min_pixels) == (16, (0.5,) * 3, 65536)
    assert processor.num_tokens_for_size(640, 640) == (640 // 32) ** 2  # 32 x 32 pixels per token


@pytest.mark.parametrize("frames", [2, 4, 5, 16, 120])
@pytest.mark.parametrize("size", [(640, 360), (20, 300), (1920, 1080), (50, 50)])
def test_clip_resize_equals_transformers(frames, size):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    width, height = size
    for min_pixels, max_pixels in ((128 * 32 * 32, 768 * 32 * 32), (4096, 25165824)):
        assert clip_smart_resize(frames, height, width, 2, 32, min_pixels, max_pixels) == smart_resize(
            frames, height, width, temporal_factor=2, factor=32, min_pixels=min_pixels,
            max_pixels=max_pixels)


def _video(processor, num_frames: int, fps: float, width: int, height: int):
    rng = np.random.default_rng(num_frames)
    frames = [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(num_frames)]
    source = {"frames": frames, "fps": fps}
    info = probe_video(source, processor.sampling, 10 ** 9)
    return frames, processor.process(load_video(source, info, num_frames, processor.sampling))


def test_video_patches_and_timestamps_equal_transformers():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as HF

    processor = Qwen3VLVideoProcessor.from_config({"size": {"shortest_edge": 4096,
                                                            "longest_edge": 6 * 64 * 64}})
    frames, video = _video(processor, 6, 2.0, 64, 64)  # 6 x 64 x 64 fits: no resize
    normalized = torch.from_numpy(np.stack([processor.frame.normalize(f) for f in frames]))
    patches, *grid = HF.patchify(None, normalized.permute(0, 3, 1, 2)[None], 16, 2, 2)
    assert video.grid_thw == tuple(grid) == (3, 4, 4)
    assert torch.equal(video.pixel_values_videos, patches[0])
    assert list(video.patch_times) == Qwen3VLProcessor._calculate_timestamps(None, [0, 1, 2, 3, 4, 5], 2.0, 2)
    assert patch_times([0.0, 0.5, 1.0], 2) == [0.25, 1.0]  # a short last patch repeats its frame


def test_planner_cap_lowers_the_clip_bound_per_frame():
    processor = Qwen3VLVideoProcessor.from_config({})
    capped = processor.with_max_pixels(64 * 64)
    _, video = _video(capped, 4, 2.0, 320, 240)
    assert video.grid_thw[1] * video.grid_thw[2] * 16 * 16 <= 64 * 64
    assert video.mm_hash != _video(processor, 4, 2.0, 320, 240)[1].mm_hash


def test_video_prompt_text_equals_transformers_rendering(tokenizer):
    """The release-time Qwen3-VL processor replaces <|vision_start|><|video_pad|>
    <|vision_end|> by per-patch "<t seconds><|vision_start|>pads<|vision_end|>"."""
    processor = Qwen3VLVideoProcessor.from_config({"size": {"shortest_edge": 4096,
                                                            "longest_edge": 6 * 64 * 64}})
    _, video = _video(processor, 6, 1.0, 64, 64)
    image = Qwen3VLImageProcessor(min_pixels=32 * 32, max_pixels=64 * 64).process(_image(64, 64, 1))
    template = "Hi<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|><|video_pad|><|vision_end|>?"
    expand = get_processor_family("qwen3_vl").expander(tokenizer)
    ids, features = expand(tokenizer.encode(template),
                           {"image": (IMAGE_PAD, [image]), "video": (VIDEO_PAD, [video])})
    rendered = "".join(timestamp_text(t) + "<|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>"
                       for t in (0.5, 2.5, 4.5))
    expected = template.replace("<|image_pad|>", "<|image_pad|>" * 4).replace(
        "<|vision_start|><|video_pad|><|vision_end|>", rendered)
    assert ids == tokenizer.encode(expected)
    image_feature, video_feature = features
    assert ids[image_feature.placeholder.offset:image_feature.placeholder.end] == [IMAGE_PAD] * 4
    video_ids = ids[video_feature.placeholder.offset:video_feature.placeholder.end]
    assert video_ids == tokenizer.encode(rendered)
    assert video_feature.data["tail_ids"] == (END,)
    assert [list(t) for t in video_feature.data["frame_text_ids"]] == [
        ([END] if i else []) + tokenizer.encode(timestamp_text(t)) + [START]
        for i, t in enumerate((0.5, 2.5, 4.5))]


def test_video_expansion_without_tokenizer_is_a_config_error():
    processor = Qwen3VLVideoProcessor.from_config({})
    _, video = _video(processor, 4, 2.0, 64, 64)
    with pytest.raises(ConfigError, match="timestamps"):
        get_processor_family("qwen3_vl").expand_placeholders([VIDEO_PAD], {"video": (VIDEO_PAD, [video])})


def test_planner_uses_32_pixels_per_token():
    family = get_processor_family("qwen3_vl")
    image_processor = Qwen3VLImageProcessor(max_pixels=512 * 512)
    geometry = family.planner_geometry(image_processor, Qwen3VLVideoProcessor.from_config({}))
    assert geometry.factor == 32
    for size in ((640, 480), (300, 1000), (33, 33)):
        planned = plan_media([ImageItem(*size)], geometry).items[0]
        assert planned.num_tokens == image_processor.num_tokens_for_size(*size)
    plan = plan_media([ImageItem(640, 480), ImageItem(480, 640)], geometry, max_visual_tokens=300)
    assert plan.total_tokens <= 300


@pytest.mark.parametrize("budget", [None, 400, 120])
def test_planned_video_tokens_are_the_tokens_the_processor_gives(budget):
    """Clip-wide bounds: the planner's arithmetic equals the processor's at the
    frame count and per-frame cap it picks, with and without a budget."""
    video_processor = Qwen3VLVideoProcessor.from_config({"size": {"shortest_edge": 8 * 32 * 32,
                                                                  "longest_edge": 512 * 32 * 32}})
    geometry = get_processor_family("qwen3_vl").planner_geometry(Qwen3VLImageProcessor(), video_processor)
    for frames, width, height in ((8, 320, 240), (16, 200, 480), (4, 640, 360)):
        planned = plan_media([VideoItem(width, height, frames)], geometry, budget).items[0]
        _, video = _video(video_processor.with_max_pixels(planned.max_pixels), planned.num_frames,
                          2.0, width, height)
        assert video.num_tokens == planned.num_tokens
        assert budget is None or planned.num_tokens <= budget
