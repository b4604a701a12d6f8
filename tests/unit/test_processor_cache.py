"""Processor cache: byte-capped LRU of processed media, content ids, multi_modal_uuids."""
from __future__ import annotations

import io

import pytest
from PIL import Image

from foveal.engine_args import EngineArgs
from foveal.errors import InvalidRequestError
from foveal.input_processor import InputProcessor
from foveal.multimodal.processor_cache import ProcessorCache, source_content_id
from foveal.sampling_params import SamplingParams
from foveal.tokenizer import Tokenizer

PROMPT = "<|vision_start|><|image_pad|><|vision_end|>Describe."


def test_lru_evicts_least_recently_used_to_stay_under_the_byte_cap():
    cache = ProcessorCache(capacity_bytes=100)
    cache.put("a", "A", 40)
    cache.put("b", "B", 40)
    assert cache.get("a") == "A"  # b is now least recently used
    cache.put("c", "C", 40)
    assert cache.get("b") is None and cache.get("a") == "A" and cache.get("c") == "C"
    assert cache.num_bytes == 80


def test_item_larger_than_the_cache_is_not_kept():
    cache = ProcessorCache(capacity_bytes=100)
    cache.put("big", "X", 101)
    assert len(cache) == 0 and cache.num_bytes == 0


def test_content_id_follows_the_bytes_not_the_source_kind(tmp_path):
    data = png_bytes(Image.new("RGB", (8, 8), (1, 2, 3)))
    path = tmp_path / "a.png"
    path.write_bytes(data)
    ids = {source_content_id(data), source_content_id(str(path)), source_content_id(path),
           source_content_id(f"file://{path}")}
    assert len(ids) == 1
    assert source_content_id(data[:-1] + b"\x00") not in ids
    assert source_content_id(str(tmp_path / "missing.png")) is None


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def processor(tiny_checkpoints) -> InputProcessor:
    config = EngineArgs.from_kwargs(tiny_checkpoints("tiny-qwen2-vl"), max_model_len=512,
                                    processor_cache_size=1 << 20).create_engine_config()
    return InputProcessor(config, Tokenizer.from_pretrained(config.model.path))


def process(processor: InputProcessor, data, uuids=None, **kwargs):
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": data}, **kwargs}
    if uuids is not None:
        prompt["multi_modal_uuids"] = {"image": uuids}
    return processor.process("r", prompt, SamplingParams(max_tokens=1)).request.mm_features[0]


def hits(processor: InputProcessor) -> int:
    return processor.get_metrics()["foveal:processor_cache_hits_total"]


def test_repeated_image_is_served_from_the_cache(processor):
    data = png_bytes(Image.new("RGB", (56, 84), (9, 9, 9)))
    first = process(processor, data)
    before = hits(processor)
    second = process(processor, data)
    assert hits(processor) == before + 1
    assert second.mm_hash == first.mm_hash and second.data["pixel_values"] is first.data["pixel_values"]


def test_image_differing_in_one_pixel_misses(processor):
    image = Image.new("RGB", (56, 56), (20, 20, 20))
    first = process(processor, png_bytes(image))
    image.putpixel((3, 3), (21, 20, 20))
    before = hits(processor)
    assert process(processor, png_bytes(image)).mm_hash != first.mm_hash
    assert hits(processor) == before


def test_uuid_without_data_is_served_from_the_cache(processor):
    first = process(processor, Image.new("RGB", (56, 56), (5, 6, 7)), ["photo-1"])
    before = hits(processor)
    again = process(processor, [None], ["photo-1"])
    assert hits(processor) == before + 1 and again.mm_hash == first.mm_hash


def test_unknown_uuid_without_data_is_an_error(processor):
    with pytest.raises(InvalidRequestError, match="unknown multi_modal_uuid 'never-sent'.*send the media again"):
        process(processor, [None], ["never-sent"])


def test_same_uuid_with_other_processing_parameters_misses(processor):
    image = Image.new("RGB", (112, 112), (50, 60, 70))
    first = process(processor, image, ["photo-2"])
    before = hits(processor)
    small = {"mm_processor_kwargs": {"max_pixels": 56 * 56}}
    other = process(processor, image, ["photo-2"], **small)
    assert hits(processor) == before and other.mm_hash != first.mm_hash
    with pytest.raises(InvalidRequestError, match="other processing parameters"):
        process(processor, [None], ["photo-2"], mm_processor_kwargs={"max_pixels": 84 * 84})


def test_uuids_must_be_parallel_to_the_data(processor):
    with pytest.raises(InvalidRequestError, match="one str or None per image"):
        process(processor, [Image.new("RGB", (28, 28))], ["a", "b"])


def test_processor_cache_stays_within_its_byte_cap(tiny_checkpoints):
    config = EngineArgs.from_kwargs(tiny_checkpoints("tiny-qwen2-vl"), max_model_len=512,
                                    processor_cache_size=100_000).create_engine_config()
    small = InputProcessor(config, Tokenizer.from_pretrained(config.model.path))
    for color in range(6):
        process(small, Image.new("RGB", (56, 56), (color, 0, 0)))
    assert 0 < small.processor_cache.num_bytes <= 100_000
    assert len(small.processor_cache) < 6
