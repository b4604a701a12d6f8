"""LLaVA image processing equals transformers' (LlavaProcessor with CLIP,
LlavaNextProcessor, LlavaOnevisionProcessor) at the real checkpoints' shapes:
pixel values, image sizes and placeholder token counts, odd aspect ratios
included; the planner's token arithmetic and its LLaVA-specific errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from foveal.errors import InvalidRequestError, MediaLimitError
from foveal.multimodal.budget import ImageItem, plan_media
from foveal.multimodal.processors.llava_family import planner_geometry, processor_from_config

# config.json / preprocessor_config.json as the llava-hf checkpoints publish them (abridged).
_CLIP = {"model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
         "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14}
_CONFIGS = {
    "llava": {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "text_config": {"model_type": "llama"}, "vision_config": _CLIP},
    "llava_next": {"architectures": ["LlavaNextForConditionalGeneration"], "model_type": "llava_next",
                   "text_config": {"model_type": "mistral", "sliding_window": None},
                   "vision_config": _CLIP},
    "llava_onevision": {"architectures": ["LlavaOnevisionForConditionalGeneration"],
                        "model_type": "llava_onevision", "text_config": {"model_type": "qwen2"}},
}
_SIZES = [(1000, 300), (300, 1000), (640, 480), (97, 701), (336, 336), (50, 40)]


def _hf_processor(variant: str, tokenizer):
    from transformers import (CLIPImageProcessorPil, LlavaNextProcessor, LlavaOnevisionProcessor,
                              LlavaProcessor)
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    kwargs = dict(tokenizer=tokenizer, image_token="<|image_pad|>")
    crop = {"crop_size": {"height": 336, "width": 336}, "size": {"shortest_edge": 336}}
    if variant == "llava":
        return LlavaProcessor(CLIPImageProcessorPil(**crop), patch_size=14, num_additional_image_tokens=1,
                              vision_feature_select_strategy="default", **kwargs)
    if variant == "llava_next":
        return LlavaNextProcessor(LlavaNextImageProcessorPil(**crop), patch_size=14,
                                  num_additional_image_tokens=1, vision_feature_select_strategy="default",
                                  **kwargs)
    return _OnevisionCounts(LlavaOnevisionImageProcessorPil(), LlavaOnevisionProcessor)


class _OnevisionCounts:
    """LlavaOnevisionProcessor needs torchvision for its video processor, which does not load
    here; this runs its image processor and its own token-count methods on the same numbers."""

    num_image_tokens, vision_aspect_ratio = 729, "anyres_max_9"

    def __init__(self, image_processor, processor_cls):
        self.image_processor, self.cls = image_processor, processor_cls

    def _get_unpadded_features(self, *args):
        return self.cls._get_unpadded_features(self, *args)

    def __call__(self, text, images, return_tensors):
        out = self.image_processor(images=images, return_tensors=return_tensors)
        height, width = out["image_sizes"][0].tolist()
        count = self.cls._get_number_of_features(self, height, width, 384, 384)
        return {**out, "input_ids": torch.full((1, count), 12)}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from foveal.loader.tiny_tokenizer import write_tiny_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _preprocessor(variant: str) -> dict:
    if variant == "llava_onevision":
        return {"size": {"height": 384, "width": 384}}
    return {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}


@pytest.mark.parametrize("variant", sorted(_CONFIGS))
def test_pixels_sizes_and_token_counts_equal_transformers(variant, tokenizer):
    ours = processor_from_config(_CONFIGS[variant], _preprocessor(variant))
    hf = _hf_processor(variant, tokenizer)
    for seed, (width, height) in enumerate(_SIZES):
        image = _image(width, height, seed)
        expected = hf(text="<|image_pad|>", images=[image], return_tensors="pt")
        processed = ours.process(image)
        pixels = expected["pixel_values"][0] if variant != "llava" else expected["pixel_values"]
        assert torch.equal(processed.pixel_values, pixels.float()), (variant, width, height)
        assert processed.num_tokens == int((expected["input_ids"] == 12).sum()), (variant, width, height)
        assert processed.num_tokens == ours.num_tokens_for_size(width, height)
        if variant != "llava":
            assert processed.image_size == tuple(expected["image_sizes"][0].tolist())
            assert processed.pixel_values.shape[0] == 1 + processed.tile_grid[0] * processed.tile_grid[1]


def test_llava_1_5_has_a_fixed_cost_and_refuses_other_sizes():
    ours = processor_from_config(_CONFIGS["llava"], _preprocessor("llava"))
    assert {ours.num_tokens_for_size(w, h) for w, h in _SIZES} == {576}
    geometry = planner_geometry(ours, None)
    plan = plan_media([ImageItem(1000, 300), ImageItem(50, 40, "low")], geometry, 1152)
    assert [p.num_tokens for p in plan.items] == [576, 576]
    with pytest.raises(MediaLimitError, match="1152"):
        plan_media([ImageItem(1000, 300), ImageItem(50, 40)], geometry, 1000)
    with pytest.raises(InvalidRequestError, match="576 tokens"):
        ours.with_overrides({"max_pixels": 200 * 200})


@pytest.mark.parametrize("variant", ["llava_next", "llava_onevision"])
def test_anyres_budget_picks_fewer_tiles_with_the_processors_own_count(variant):
    ours = processor_from_config(_CONFIGS[variant], _preprocessor(variant))
    geometry = planner_geometry(ours, None)
    full = plan_media([ImageItem(1000, 300)], geometry).items[0]
    budget = full.num_tokens - 1
    planned = plan_media([ImageItem(1000, 300)], geometry, budget).items[0]
    assert planned.num_tokens <= budget and planned.downsampled
    smaller = ours.with_overrides({"max_pixels": planned.max_pixels})
    processed = smaller.process(_image(1000, 300, 0))
    assert processed.num_tokens == planned.num_tokens
    assert processed.pixel_values.shape[0] < ours.process(_image(1000, 300, 0)).pixel_values.shape[0]
    assert (planned.height, planned.width) == (processed.tile_grid[0] * ours.tile_size,
                                               processed.tile_grid[1] * ours.tile_size)
    with pytest.raises(InvalidRequestError, match="smallest anyres canvas"):
        ours.with_overrides({"max_pixels": ours.min_pixels - 1})


def test_onevision_video_budget_drops_frames_and_counts_the_newline():
    from foveal.multimodal.budget import VideoItem
    from foveal.multimodal.processors.llava_video import LlavaVideoProcessor

    image = processor_from_config(_CONFIGS["llava_onevision"], _preprocessor("llava_onevision"))
    video = LlavaVideoProcessor(frame=image)
    geometry = planner_geometry(image, video)
    full = plan_media([VideoItem(640, 360, 16)], geometry).items[0]
    assert full.num_tokens == 16 * 14 * 14 + 1  # 27x27 features pooled to 14x14 per frame, one newline
    cut = plan_media([VideoItem(640, 360, 16)], geometry, 1000).items[0]
    assert (cut.num_frames, cut.num_tokens) == (5, 5 * 196 + 1)
    with pytest.raises(MediaLimitError):
        plan_media([VideoItem(640, 360, 16)], geometry, 4 * 196)  # below min_frames=4 + newline
    with pytest.raises(InvalidRequestError, match="images only"):
        LlavaVideoProcessor().with_overrides({"fps": 2})


def test_onevision_multi_image_mode_equals_transformers():
    """Several images in one prompt: transformers pads each to a square (mean colour) and keeps one
    view; the placeholder is the view's 729 rows plus a newline. One image: anyres as before."""
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    hf = LlavaOnevisionImageProcessorPil(image_mean=[0.5] * 3, image_std=[0.5] * 3)
    ours = processor_from_config(_CONFIGS["llava_onevision"],
                                 {**_preprocessor("llava_onevision"), "image_mean": [0.5] * 3,
                                  "image_std": [0.5] * 3})
    images = [_image(w, h, seed) for seed, (w, h) in enumerate(_SIZES)]
    expected = hf(images=[images], return_tensors="pt")
    assert expected["batch_num_images"].tolist() == [len(images)]
    several = ours.in_prompt_of(len(images))
    assert several.single_view and ours.in_prompt_of(1) is ours
    assert several.tensor_params() != ours.tensor_params()  # distinct cache keys
    for index, image in enumerate(images):
        processed = several.process(image)
        assert torch.equal(processed.pixel_values, expected["pixel_values"][index, :1].float()), index
        assert processed.num_tokens == 730 == several.num_tokens_for_size(image.width, image.height)
        assert processed.tile_grid == (0, 0)
    geometry = planner_geometry(several, None)
    assert [p.num_tokens for p in plan_media([ImageItem(1000, 300), ImageItem(50, 40, "low")],
                                             geometry).items] == [730, 730]
    with pytest.raises(InvalidRequestError, match="several images"):
        several.with_overrides({"max_pixels": 384 * 384 * 4})
    next_processor = processor_from_config(_CONFIGS["llava_next"], _preprocessor("llava_next"))
    assert next_processor.in_prompt_of(3) is next_processor  # NeXT tiles every image
