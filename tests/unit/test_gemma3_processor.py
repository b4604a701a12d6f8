"""Gemma 3's processor equals transformers': pixels with and without
pan-and-scan (odd aspect ratios included), the expanded prompt tokens, the
planner's arithmetic (crop count as the dial) and the refusals."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

from foveal.errors import InvalidRequestError, PlaceholderMismatchError
from foveal.loader.presets import get_preset
from foveal.loader.tiny_tokenizer import write_tiny_tokenizer
from foveal.multimodal.budget import ImageItem, plan_media
from foveal.multimodal.inputs import BIDIRECTIONAL_KEY
from foveal.multimodal.processors import get_processor_family
from foveal.multimodal.processors.gemma3 import Gemma3ImageProcessor, gemma3_expander
from foveal.multimodal.processors.gemma3_family import preprocessor_config
from foveal.tokenizer import Tokenizer

PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32,
                "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}
# (width, height): square, wide, tall, odd ratios, one too narrow to crop
SIZES = [(64, 64), (300, 97), (61, 250), (1000, 300), (257, 190), (70, 20)]


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def processor() -> Gemma3ImageProcessor:
    hf_config = get_preset("tiny-gemma3")
    return Gemma3ImageProcessor.from_config(hf_config, preprocessor_config(hf_config))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("gemma3_tokenizer")
    write_tiny_tokenizer(folder)
    return Tokenizer.from_pretrained(folder)


def _hf(processor: Gemma3ImageProcessor, images: list[Image.Image], **kwargs):
    side = processor.image_size
    hf = Gemma3ImageProcessorPil(size={"height": side, "width": side}, image_mean=[0.5] * 3,
                                 image_std=[0.5] * 3, resample=2)
    return hf(images=images, return_tensors="pt", **kwargs)


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_pixels_equal_transformers(processor, pan_and_scan):
    images = [_image(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    kwargs = PAN_AND_SCAN if pan_and_scan else {}
    expected = _hf(processor, images, **kwargs)
    ours = [processor.with_overrides(kwargs).process(image) for image in images]
    assert [item.num_crops for item in ours] == expected["num_crops"].tolist()
    if pan_and_scan:
        assert [item.num_crops for item in ours] == [0, 3, 4, 3, 2, 0]
    pixels = torch.cat([item.pixel_values for item in ours])
    assert torch.equal(pixels, expected["pixel_values"])


def test_token_counts_follow_the_crops(processor):
    scanning = processor.with_overrides(PAN_AND_SCAN)
    for seed, (w, h) in enumerate(SIZES):
        item = scanning.process(_image(w, h, seed))
        assert scanning.num_tokens_for_size(w, h) == item.num_tokens == 16 * (1 + item.num_crops)
    assert processor.num_tokens_for_size(1000, 300) == 16  # no pan-and-scan: one view


def test_max_pixels_caps_the_crops(processor):
    scanning = processor.with_overrides(PAN_AND_SCAN)
    view = processor.min_pixels
    assert scanning.max_pixels == 5 * view
    assert scanning.with_overrides({"max_pixels": 4 * view}).num_crops(1000, 300) == (3, 1)
    assert scanning.with_overrides({"max_pixels": 2 * view}).num_crops(1000, 300) == (0, 0)  # < 2 crops
    assert scanning.with_overrides({"max_pixels": 5 * view}).tensor_params() != \
        scanning.with_overrides({"max_pixels": 4 * view}).tensor_params()


def test_planner_trades_crops_for_the_budget(processor):
    family = get_processor_family("gemma3")
    geometry = family.planner_geometry(processor.with_overrides(PAN_AND_SCAN), None)
    items = [ImageItem(1000, 300), ImageItem(64, 64)]
    assert [p.num_tokens for p in plan_media(items, geometry).items] == [64, 16]
    assert [p.num_tokens for p in plan_media(items, geometry, 64).items] == [48, 16]
    assert [p.num_tokens for p in plan_media(items, geometry, 40).items] == [16, 16]
    low = plan_media([ImageItem(1000, 300, "low")], geometry).items[0]
    assert low.num_tokens == 16
    no_scan = family.planner_geometry(processor, None)
    assert [p.num_tokens for p in plan_media(items, no_scan).items] == [16, 16]


def _hf_text(prompt: str, num_crops: list[int], tokenizer: Tokenizer, tokens_per_image: int) -> str:
    """transformers' Gemma3Processor text expansion, with the tiny tokenizer's tokens."""
    boi, image, eoi = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
    owner = SimpleNamespace(full_image_sequence=f"\n\n{boi}{image * tokens_per_image}{eoi}\n\n")
    parts = prompt.split(boi)
    text = parts[0]
    for index, part in enumerate(parts[1:]):
        text += Gemma3Processor.replace_image_token(owner, {"num_crops": num_crops}, index) + part
    return text


@pytest.mark.parametrize("prompt", [
    "<|im_start|>user\n<|vision_start|>Describe it.<|im_end|>\n",
    "Two:\n<|vision_start|><|vision_start|>\n\nwhich is wider?",
    "<|vision_start|> and then <|vision_start|>",
])
def test_expanded_prompt_tokenizes_like_transformers(processor, tokenizer, prompt):
    scanning = processor.with_overrides(PAN_AND_SCAN)
    images = [scanning.process(_image(300, 97, 1)), scanning.process(_image(64, 64, 2))]
    images = images[:prompt.count("<|vision_start|>")]
    expand = gemma3_expander(tokenizer)
    ids, features = expand(tokenizer.encode(prompt), {"image": (12, images), "video": (-1, [])})
    expected = _hf_text(prompt, [item.num_crops for item in images], tokenizer, 16)
    assert ids == tokenizer.encode(expected)
    for item, feature in zip(images, features):
        runs = feature.data[BIDIRECTIONAL_KEY]
        assert [length for _, length in runs] == [16] * (1 + item.num_crops)
        span = ids[feature.placeholder.offset:feature.placeholder.end]
        assert list(feature.data["token_ids"]) == span
        assert all(span[offset + i] == 12 for offset, length in runs for i in range(length))
        assert span.count(12) == item.num_tokens


def test_expansion_checks_the_placeholder_count(processor, tokenizer):
    expand = gemma3_expander(tokenizer)
    item = processor.process(_image(64, 64, 0))
    with pytest.raises(PlaceholderMismatchError, match="1 <start_of_image> placeholder"):
        expand(tokenizer.encode("<|vision_start|> hi"), {"image": (12, [item, item])})


def test_video_and_bad_options_are_refused(processor, tmp_path):
    family = get_processor_family("gemma3")
    video = family.video_processor_class.from_pretrained(str(tmp_path))
    with pytest.raises(InvalidRequestError, match="images only"):
        video.process(object())
    with pytest.raises(InvalidRequestError, match="for videos"):
        video.with_overrides({"fps": 2})
    with pytest.raises(InvalidRequestError, match="pan_and_scan_max_num_crops"):
        processor.with_overrides({"pan_and_scan_max_num_crops": "4"})
    with pytest.raises(InvalidRequestError, match="accepts"):
        processor.with_overrides({"min_pixels": 10})


def test_checkpoint_files_build_the_processor(tmp_path):
    hf_config = get_preset("tiny-gemma3")
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {**preprocessor_config(hf_config), "do_pan_and_scan": None}))  # hub files leave nulls
    loaded = Gemma3ImageProcessor.from_pretrained(str(tmp_path), {"do_pan_and_scan": True})
    assert loaded.do_pan_and_scan and loaded.image_size == 112 and loaded.tokens_per_image == 16
    assert (loaded.tokens.boi, loaded.tokens.eoi, loaded.tokens.image) == (9, 10, 12)


def test_mm_hash_follows_the_tensors(processor):
    square, wide = _image(64, 64, 0), _image(300, 97, 1)
    scanning = processor.with_overrides(PAN_AND_SCAN)
    assert scanning.process(square).mm_hash == processor.process(square).mm_hash  # no crops
    assert scanning.process(wide).mm_hash != processor.process(wide).mm_hash
    capped = scanning.with_overrides({"max_pixels": 3 * processor.min_pixels})
    assert capped.process(wide).num_crops == 2
    assert capped.process(wide).mm_hash != scanning.process(wide).mm_hash
