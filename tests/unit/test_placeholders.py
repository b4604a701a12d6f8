import pytest
import torch

from foveal.errors import PlaceholderMismatchError
from foveal.multimodal.inputs import PlaceholderRange
from foveal.multimodal.processors.qwen2_vl import ProcessedImage, expand_placeholders

IMAGE = 151655
VISION_START = 151652
VISION_END = 151653


def item(num_tokens: int, name: str) -> ProcessedImage:
    grid_thw = (1, 2, 2 * num_tokens)
    pixel_values = torch.full((4 * num_tokens, 1176), float(num_tokens))  # (num_patches, C*T*P*P)
    return ProcessedImage(pixel_values=pixel_values, grid_thw=grid_thw, num_tokens=num_tokens, mm_hash=name)


def test_single_placeholder_expands_to_num_tokens():
    ids = [1, VISION_START, IMAGE, VISION_END, 2]
    expanded, features = expand_placeholders(ids, [item(3, "a")], IMAGE)
    assert expanded == [1, VISION_START, IMAGE, IMAGE, IMAGE, VISION_END, 2]
    assert features[0].placeholder == PlaceholderRange(offset=2, length=3)


def test_two_placeholders_get_offsets_after_earlier_expansion():
    ids = [7, VISION_START, IMAGE, VISION_END, 8, 9, VISION_START, IMAGE, VISION_END]
    expanded, features = expand_placeholders(ids, [item(4, "a"), item(2, "b")], IMAGE)
    assert len(expanded) == len(ids) + 3 + 1
    assert [f.placeholder for f in features] == [PlaceholderRange(2, 4), PlaceholderRange(10, 2)]
    for feature in features:
        span = expanded[feature.placeholder.offset : feature.placeholder.end]
        assert span == [IMAGE] * feature.placeholder.length
        assert expanded[feature.placeholder.offset - 1] == VISION_START
        assert expanded[feature.placeholder.end] == VISION_END
    assert expanded[7:9] == [8, 9]


def test_features_carry_hash_tensors_and_grid_in_order():
    first, second = item(1, "hash-a"), item(5, "hash-b")
    _, features = expand_placeholders([IMAGE, IMAGE], [first, second], IMAGE)
    assert [f.mm_hash for f in features] == ["hash-a", "hash-b"]
    assert [f.modality for f in features] == ["image", "image"]
    assert features[1].data["pixel_values"] is second.pixel_values
    assert features[1].data["grid_thw"] == second.grid_thw
    assert features[1].num_encoder_tokens == 5


def test_prompt_without_images_is_unchanged():
    ids = [1, 2, 3]
    assert expand_placeholders(ids, [], IMAGE) == ([1, 2, 3], [])


@pytest.mark.parametrize(
    "ids,num_items,message",
    [
        ([IMAGE, 5, IMAGE], 1, "2 image placeholder(s) but 1 image(s)"),
        ([5, 6], 2, "0 image placeholder(s) but 2 image(s)"),
        ([IMAGE], 0, "1 image placeholder(s) but 0 image(s)"),
    ],
)
def test_placeholder_count_mismatch_raises_with_counts(ids, num_items, message):
    items = [item(2, str(i)) for i in range(num_items)]
    with pytest.raises(PlaceholderMismatchError) as info:
        expand_placeholders(ids, items, IMAGE)
    assert message in str(info.value)
    assert "one <|image_pad|> per image" in str(info.value)
