"""Idefics3 / SmolVLM image processing equals transformers' PIL image processors
(pixel values, tile grid) at and around the tile and longest-edge limits, odd
aspect ratios, without splitting, and at the planner's lower longest edge; the
expanded prompt text equals transformers'; the planner's tile arithmetic; config
reading; clear errors for videos and bad options."""
from __future__ import annotations

import dataclasses
import numpy as np
import pytest
from PIL import Image
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from foveal.errors import ConfigError, InvalidRequestError, PlaceholderMismatchError
from foveal.loader.hf_config import model_config_from_dict
from foveal.loader.presets import get_preset
from foveal.multimodal.budget import ImageItem, plan_media
from foveal.multimodal.processors import get_processor_family
from foveal.multimodal.processors.idefics3 import (Idefics3ImageProcessor, MarkerTokens, idefics3_expander,
                                                   replacement_text)
from foveal.multimodal.processors.idefics3_family import preprocessor_config

TILE, EDGE = 64, 256


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def processor() -> Idefics3ImageProcessor:
    config = get_preset("tiny-idefics3")
    return Idefics3ImageProcessor.from_config(config, {**preprocessor_config(config),
                                                       "size": {"longest_edge": EDGE}})


def _hf(edge: int = EDGE, processor_class=Idefics3ImageProcessorPil, **kwargs):
    return processor_class(size={"longest_edge": edge}, max_image_size={"longest_edge": TILE},
                           image_mean=[0.5] * 3, image_std=[0.5] * 3, **kwargs)


def _assert_equal(ours: Idefics3ImageProcessor, hf, image: Image.Image) -> tuple[int, int]:
    out = hf(images=[image], return_tensors="np", return_row_col_info=True)
    item = ours.process(image)
    rows, cols = out["rows"][0][0], out["cols"][0][0]
    assert (item.rows, item.cols) == (rows, cols)
    np.testing.assert_array_equal(item.pixel_values.numpy(), out["pixel_values"][0])
    assert item.num_tokens == 16 * out["pixel_values"].shape[1]
    assert ours.num_tokens_for_size(image.width, image.height) == item.num_tokens
    return rows, cols


@pytest.mark.parametrize("size, grid", [
    ((64, 64), (4, 4)), ((65, 64), (4, 4)), ((63, 64), (4, 4)),  # at / around one tile: upscaled
    ((256, 256), (4, 4)), ((257, 100), (2, 4)), ((2000, 1500), (3, 4)),  # the longest edge and far above
    ((300, 7), (1, 4)), ((7, 300), (4, 1)), ((77, 61), (4, 4)), ((100, 30), (2, 4)),  # odd aspect ratios
])
def test_split_image_equals_transformers(processor, size, grid):
    assert _assert_equal(processor, _hf(), _image(*size, seed=sum(size))) == grid


@pytest.mark.parametrize("size", [(64, 64), (65, 64), (300, 7), (2000, 1500)])
def test_one_tile_longest_edge_and_no_splitting_equal_transformers(processor, size):
    image = _image(*size, seed=1)
    one_tile = processor.with_overrides({"max_pixels": TILE * TILE + 5})
    assert _assert_equal(one_tile, _hf(TILE), image) == (0, 0)
    unsplit = processor.with_overrides({"do_image_splitting": False})
    assert _assert_equal(unsplit, _hf(do_image_splitting=False), image) == (0, 0)


def test_planner_longest_edge_equals_transformers_size(processor):
    image = _image(150, 97, 5)
    capped = processor.with_overrides({"max_pixels": 140 * 140})  # two tiles' edge fit
    assert capped.longest_edge == 128
    assert _assert_equal(capped, _hf(128), image) == (2, 2)
    assert _assert_equal(processor, _hf(processor_class=SmolVLMImageProcessorPil), image) == (3, 4)


@pytest.mark.parametrize("rows, cols", [(0, 0), (1, 2), (3, 4)])
def test_replacement_text_equals_transformers(rows, cols):
    ours = replacement_text(MarkerTokens(), rows, cols, 5)
    assert ours == get_image_prompt_string(rows, cols, 5, "<fake_token_around_image>", "<image>",
                                           "<global-img>")


def test_planner_counts_tiles(processor):
    geometry = get_processor_family("idefics3").planner_geometry(processor, None)
    items = [ImageItem(1000, 300), ImageItem(64, 64)]
    # 2 x 4 tiles + global, 4 x 4 tiles + global at the 256px edge
    assert [p.num_tokens for p in plan_media(items, geometry).items] == [9 * 16, 17 * 16]
    # a 192px edge (1 x 3 tiles + global) and a 128px one (2 x 2 + global)
    assert [p.num_tokens for p in plan_media(items, geometry, 200).items] == [4 * 16, 5 * 16]
    assert [p.num_tokens for p in plan_media(items, geometry, 40).items] == [16, 16]
    low = plan_media([ImageItem(1000, 300, "low")], geometry).items[0]
    assert low.num_tokens < 9 * 16


class _Tokenizer:
    """Encodes each marker string as one id, anything else byte by byte (100 + byte)."""

    names = {"<image>": 7, "<fake_token_around_image>": 8, "<global-img>": 9}

    def encode(self, text: str) -> list[int]:
        ids, index = [], 0
        while index < len(text):
            name = next((n for n in self.names if text.startswith(n, index)), None)
            ids.append(self.names[name] if name else 100 + ord(text[index]))
            index += len(name) if name else 1
        return ids


def test_feature_covers_markers_and_lists_image_runs(processor):
    real_names = dataclasses.replace(processor, markers=MarkerTokens())
    item = real_names.process(_image(100, 30, 1))  # 2 x 4 tiles + global
    expand = idefics3_expander(_Tokenizer())
    ids, features = expand([1, 7, 2], {"image": (7, [item])})
    (feature,) = features
    span = ids[feature.placeholder.offset:feature.placeholder.offset + feature.placeholder.length]
    assert ids[1] == 8 and feature.placeholder.offset == 2 + len("<row_1_col_1>")  # after the marker
    assert span[0] == span[-1] == 7
    assert tuple(span) == feature.data["token_ids"] and ids[-1] == 2
    runs = feature.data["image_runs"]
    assert [length for _, length in runs] == [16] * 9
    assert all(set(span[o:o + n]) == {7} for o, n in runs) and span.count(7) == 9 * 16
    with pytest.raises(PlaceholderMismatchError, match="1 <image> placeholder"):
        expand([7], {"image": (7, [item, item])})


def test_video_and_bad_options_are_clear_errors(processor):
    with pytest.raises(InvalidRequestError, match="images only"):
        get_processor_family("idefics3").video_processor_class().process(None)
    with pytest.raises(InvalidRequestError, match="takes no video"):
        get_processor_family("smolvlm").video_processor_class().process(None)
    with pytest.raises(InvalidRequestError, match="unknown mm_processor_kwargs"):
        processor.with_overrides({"fps": 2})
    with pytest.raises(InvalidRequestError, match="below one Idefics3 tile"):
        processor.with_overrides({"max_pixels": 100})


def test_hash_follows_the_tile_grid(processor):
    image = _image(150, 97, 5)
    assert processor.process(image).mm_hash == processor.process(image.copy()).mm_hash
    assert processor.process(image).mm_hash != processor.with_overrides({"max_pixels": 128 * 128}
                                                                        ).process(image).mm_hash


def test_sparse_hub_config_and_preset_read():
    hub = {"architectures": ["SmolVLMForConditionalGeneration"], "model_type": "smolvlm",
           "scale_factor": 4, "image_token_id": 49190,
           "vision_config": {"hidden_size": 768, "image_size": 512, "patch_size": 16,
                             "num_attention_heads": 12},
           "text_config": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49280,
                           "rope_theta": 100000}}
    config = model_config_from_dict(hub)
    assert config.family_config.image_seq_len(config.vision.patch_size) == 64
    text = config.text
    assert (text.rms_norm_eps, text.attention_bias, config.image_token_id) == (1e-5, False, 49190)
    assert model_config_from_dict(get_preset("smolvlm-256m")).text.hidden_size == 576
    with pytest.raises(ConfigError, match="rope_type"):
        model_config_from_dict({**hub, "text_config": {**hub["text_config"],
                                                       "rope_scaling": {"rope_type": "dynamic"}}})
    eight_b = model_config_from_dict(get_preset("idefics3-8b"))
    assert eight_b.text.rope_scaling.rope_type == "llama3"
    assert eight_b.family_config.image_seq_len(eight_b.vision.patch_size) == 169
    with pytest.raises(ConfigError, match="pixel shuffle"):
        model_config_from_dict({**hub, "scale_factor": 3})
