import base64
import io
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from foveal.errors import CheckpointError, ConfigError, InvalidRequestError, MediaError
from foveal.multimodal.hashing import hash_image, mm_hash
from foveal.multimodal.media.image import load_image
from foveal.multimodal.processors import get_image_processor_class
from foveal.multimodal.processors.qwen2_vl import Qwen2VLImageProcessor, smart_resize

LIMIT = 50_000_000
QWEN2_VL_CONFIG = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(Image.new(mode, (1, 1)).getbands())
    pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode=mode)


def assert_matches_transformers(image: Image.Image, **kwargs) -> None:
    hf = Qwen2VLImageProcessorPil(**kwargs)(images=[image], return_tensors="np")
    ours = Qwen2VLImageProcessor.from_config(kwargs).process(load_image(image, LIMIT))
    assert ours.grid_thw == tuple(hf["image_grid_thw"][0].tolist())
    assert ours.pixel_values.dtype == torch.float32
    assert ours.pixel_values.shape == hf["pixel_values"].shape
    np.testing.assert_allclose(ours.pixel_values.numpy(), hf["pixel_values"], rtol=0, atol=1e-6)
    assert ours.num_tokens == hf["pixel_values"].shape[0] // 4


@pytest.mark.parametrize(
    "width,height",
    [(20, 20), (333, 517), (1000, 150), (150, 1000), (1600, 1200), (28, 28), (57, 3000)],
)
def test_pixel_values_match_transformers_default_params(width, height):
    assert_matches_transformers(random_image(width, height, seed=width + height))


@pytest.mark.parametrize("width,height", [(1000, 1004), (1008, 1008), (995, 1008)])
def test_pixel_values_match_transformers_near_max_pixels(width, height):
    assert_matches_transformers(random_image(width, height, seed=width), max_pixels=28 * 28 * 1280)


@pytest.mark.parametrize("width,height", [(20, 20), (333, 517), (640, 480), (1000, 150)])
def test_pixel_values_match_transformers_custom_min_max_pixels(width, height):
    assert_matches_transformers(random_image(width, height, seed=1), min_pixels=100 * 28 * 28, max_pixels=256 * 28 * 28)


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "LA", "CMYK"])
def test_pixel_values_match_transformers_for_non_rgb_modes(mode):
    base = random_image(61, 45, mode="RGBA", seed=2)
    image = base.convert(mode) if mode != "P" else base.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE)
    assert_matches_transformers(image)


def test_pixel_values_match_transformers_with_other_filter_and_normalization():
    assert_matches_transformers(
        random_image(123, 77, seed=4),
        resample=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        patch_size=16,
        merge_size=2,
    )


def test_pixel_values_match_transformers_without_rescale_or_normalize():
    assert_matches_transformers(random_image(90, 60, seed=6), do_rescale=False, do_normalize=False)


def test_image_is_repeated_temporal_patch_size_times():
    processed = Qwen2VLImageProcessor().process(random_image(56, 56))
    rows = processed.pixel_values.view(-1, 3, 2, 14, 14)  # (N, C, T, P, P)
    assert torch.equal(rows[:, :, 0], rows[:, :, 1])


def test_grid_and_num_tokens_follow_resized_size():
    processed = Qwen2VLImageProcessor().process(random_image(560, 280))
    assert processed.grid_thw == (1, 20, 40)
    assert processed.num_tokens == 200
    assert processed.pixel_values.shape == (800, 3 * 2 * 14 * 14)


@pytest.mark.parametrize("width,height", [(20, 20), (333, 517), (1600, 1200), (1000, 150)])
def test_num_tokens_for_size_equals_processed_count(width, height):
    processor = Qwen2VLImageProcessor.from_config({}, {"max_pixels": 500_000})
    processed = processor.process(random_image(width, height))
    assert processor.num_tokens_for_size(width, height) == processed.num_tokens
    hf_patches = Qwen2VLImageProcessorPil(max_pixels=500_000).get_number_of_image_patches(height, width)
    assert processed.num_tokens == hf_patches // 4


def test_extreme_aspect_ratio_raises_media_error():
    with pytest.raises(MediaError, match="aspect ratio"):
        Qwen2VLImageProcessor().process(Image.new("RGB", (2010, 10)))


def test_unresized_image_with_bad_size_raises_media_error():
    processor = Qwen2VLImageProcessor.from_config({"do_resize": False})
    with pytest.raises(MediaError, match="multiples of 28"):
        processor.process(Image.new("RGB", (30, 56)))
    assert processor.process(Image.new("RGB", (56, 28))).grid_thw == (1, 2, 4)


def test_from_config_reads_qwen2_vl_preprocessor_config():
    processor = Qwen2VLImageProcessor.from_config(QWEN2_VL_CONFIG)
    assert (processor.min_pixels, processor.max_pixels) == (3136, 12845056)
    assert processor.image_mean == tuple(QWEN2_VL_CONFIG["image_mean"])
    assert processor.resample == 3


def test_from_config_reads_size_edges_and_prefers_min_max_pixels():
    size_only = Qwen2VLImageProcessor.from_config({"size": {"shortest_edge": 1000, "longest_edge": 9000}})
    assert (size_only.min_pixels, size_only.max_pixels) == (1000, 9000)
    size = {"shortest_edge": 1000, "longest_edge": 9000}
    both = Qwen2VLImageProcessor.from_config({"size": size, "max_pixels": 7000})
    assert both.max_pixels == 7000


def test_overrides_replace_min_and_max_pixels():
    processor = Qwen2VLImageProcessor.from_config(QWEN2_VL_CONFIG, {"min_pixels": 100, "max_pixels": 5000})
    assert (processor.min_pixels, processor.max_pixels) == (100, 5000)


def test_unknown_override_raises_listing_accepted_keys():
    with pytest.raises(InvalidRequestError, match=r"\['min_pixels', 'max_pixels'\]"):
        Qwen2VLImageProcessor.from_config(QWEN2_VL_CONFIG, {"max_pixel": 5000})


@pytest.mark.parametrize(
    "overrides", [{"max_pixels": -1}, {"min_pixels": "big"}, {"min_pixels": 10_000, "max_pixels": 5_000}]
)
def test_invalid_override_value_raises_invalid_request(overrides):
    with pytest.raises(InvalidRequestError):
        Qwen2VLImageProcessor().with_overrides(overrides)


@pytest.mark.parametrize("config", [{"resample": 99}, {"image_mean": [0.5, 0.5]}, {"patch_size": 0}])
def test_invalid_preprocessor_config_raises_config_error(config):
    with pytest.raises(ConfigError):
        Qwen2VLImageProcessor.from_config(config)


def test_from_pretrained_missing_file_raises_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="preprocessor_config.json"):
        Qwen2VLImageProcessor.from_pretrained(tmp_path)


def test_to_config_dict_round_trips_through_transformers(tmp_path):
    processor = Qwen2VLImageProcessor.from_config(QWEN2_VL_CONFIG, {"min_pixels": 4 * 784, "max_pixels": 64 * 784})
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(processor.to_config_dict()))
    assert Qwen2VLImageProcessor.from_pretrained(tmp_path) == processor
    hf_processor = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    image = random_image(300, 200)
    hf = hf_processor(images=[image], return_tensors="np")
    np.testing.assert_allclose(processor.process(image).pixel_values.numpy(), hf["pixel_values"], rtol=0, atol=1e-6)


def test_registry_maps_qwen_model_types_to_processor():
    assert get_image_processor_class("qwen2_vl") is Qwen2VLImageProcessor
    assert get_image_processor_class("qwen2_5_vl") is Qwen2VLImageProcessor
    with pytest.raises(ConfigError, match="qwen2_vl"):
        get_image_processor_class("llama")


def test_mm_hash_changes_when_one_pixel_changes():
    image = random_image(64, 64)
    changed = image.copy()
    changed.putpixel((10, 20), tuple((v + 1) % 256 for v in image.getpixel((10, 20))))
    processor = Qwen2VLImageProcessor()
    assert processor.process(image).mm_hash != processor.process(changed).mm_hash


def test_mm_hash_changes_when_max_pixels_changes():
    image = random_image(64, 64)
    base = Qwen2VLImageProcessor()
    assert base.process(image).mm_hash != base.with_overrides({"max_pixels": 200_000}).process(image).mm_hash


def test_mm_hash_equal_for_same_content_from_different_sources(tmp_path):
    image = random_image(50, 40, mode="RGBA")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    path = tmp_path / "image.png"
    path.write_bytes(buffer.getvalue())
    data_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    processor = Qwen2VLImageProcessor()
    hashes = {processor.process(load_image(s, LIMIT)).mm_hash for s in (image, buffer.getvalue(), path, data_url)}
    assert len(hashes) == 1


def test_mm_hash_is_full_sha256_and_key_order_free():
    digest = mm_hash("abc", {"a": 1, "b": [0.5, 2]})
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert digest == mm_hash("abc", {"b": [0.5, 2], "a": 1})
    assert digest != mm_hash("abd", {"a": 1, "b": [0.5, 2]})


def test_hash_image_distinguishes_palettes_and_sizes():
    indices = Image.new("P", (4, 4), 0)
    other = indices.copy()
    other.putpalette([255, 0, 0] * 256)
    assert hash_image(indices) != hash_image(other)
    assert hash_image(Image.new("L", (4, 8))) != hash_image(Image.new("L", (8, 4)))


FACTORS = st.sampled_from([14, 28, 32, 56])


@st.composite
def resize_cases(draw):
    short = draw(st.integers(1, 2000))
    long = draw(st.integers(short, min(short * 200, 20_000)))
    height, width = (short, long) if draw(st.booleans()) else (long, short)
    min_pixels = draw(st.integers(1, 2_000_000))
    max_pixels = draw(st.integers(min_pixels, 20_000_000))
    return height, width, draw(FACTORS), min_pixels, max_pixels


@settings(max_examples=300, deadline=None)
@given(resize_cases())
def test_smart_resize_equals_transformers(case):
    assert smart_resize(*case) == hf_smart_resize(*case)


@settings(max_examples=300, deadline=None)
@given(resize_cases())
def test_smart_resize_sides_are_positive_multiples_of_factor(case):
    factor = case[2]
    resized_h, resized_w = smart_resize(*case)
    assert resized_h % factor == 0 and resized_w % factor == 0
    assert resized_h >= factor and resized_w >= factor


@settings(max_examples=300, deadline=None)
@given(resize_cases())
def test_smart_resize_keeps_aspect_within_one_factor_per_side(case):
    height, width, factor, _, _ = case
    resized_h, resized_w = smart_resize(*case)
    # Some common scale s puts each side within one factor of its resized value.
    low = max((resized_h - factor) / height, (resized_w - factor) / width)
    high = min((resized_h + factor) / height, (resized_w + factor) / width)
    assert low <= high


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 4000),
    st.floats(1.0, 4.0),
    FACTORS,
    st.integers(4, 1000),
    st.integers(4, 64),
)
def test_smart_resize_area_within_bounds_when_there_is_room(short, aspect, factor, min_cells, spread):
    # With aspect <= 4, min_pixels >= 4 * factor**2 and max_pixels >= 4 * min_pixels the
    # rounding always has room to land inside [min_pixels, max_pixels].
    min_pixels = min_cells * factor * factor
    max_pixels = spread * min_pixels
    resized_h, resized_w = smart_resize(short, int(short * aspect), factor, min_pixels, max_pixels)
    assert min_pixels <= resized_h * resized_w <= max_pixels


def test_smart_resize_rejects_aspect_ratio_over_200():
    with pytest.raises(MediaError, match="at most 200:1"):
        smart_resize(10, 2001, 28, 3136, 1_000_000)
    assert smart_resize(10, 2000, 28, 3136, 1_000_000)
