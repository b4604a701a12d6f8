"""The processor registry: one ProcessorFamily per HF model_type, imported on
first lookup, and the input processor taking everything model-specific from it."""
from __future__ import annotations

import dataclasses

import pytest
from PIL import Image

from foveal.engine_args import EngineArgs
from foveal.errors import ConfigError
from foveal.input_processor import InputProcessor
from foveal.multimodal.budget import Geometry
from foveal.multimodal.processors import get_processor_family, register_processor_family
from foveal.multimodal.processors.qwen2_vl import Qwen2VLImageProcessor
from foveal.multimodal.processors.qwen2_vl_family import QWEN2_VL
from foveal.multimodal.processors.qwen2_vl_video import Qwen2VLVideoProcessor
from foveal.sampling_params import SamplingParams
from foveal.tokenizer import Tokenizer

EXPANDED: list[dict] = []  # what RECORDING_FAMILY's placeholder expansion was given


def _recording_expand(token_ids, items_by_modality):
    EXPANDED.append({modality: len(items) for modality, (_, items) in items_by_modality.items()})
    return QWEN2_VL.expand_placeholders(token_ids, items_by_modality)


RECORDING_FAMILY = dataclasses.replace(QWEN2_VL, name="recording", expand_placeholders=_recording_expand)


def test_qwen_model_types_share_the_qwen2_vl_family():
    family = get_processor_family("qwen2_5_vl")
    assert family is get_processor_family("qwen2_vl")
    assert family.image_processor_class is Qwen2VLImageProcessor
    assert family.video_processor_class is Qwen2VLVideoProcessor
    assert set(family.image_override_keys) == {"min_pixels", "max_pixels"}
    assert {"fps", "video_max_pixels"} <= set(family.video_override_keys)


def test_unknown_model_type_names_the_supported_ones():
    with pytest.raises(ConfigError, match=r"model_type 'llama'; supported: \[.*'qwen2_5_vl', 'qwen2_vl'"):
        get_processor_family("llama")


def test_planner_geometry_comes_from_the_processors():
    image = Qwen2VLImageProcessor(min_pixels=8 * 784, max_pixels=512 * 784)
    video = Qwen2VLVideoProcessor.from_config({"min_pixels": 64 * 784, "max_pixels": 256 * 784,
                                               "min_frames": 6})
    assert QWEN2_VL.planner_geometry(image, video) == Geometry(
        patch_size=14, merge_size=2, temporal_patch_size=2, image_min_pixels=8 * 784,
        image_max_pixels=512 * 784, video_min_pixels=64 * 784, video_max_pixels=256 * 784, min_frames=6)


def test_input_processor_expands_placeholders_with_the_registered_family(tiny_checkpoints):
    args = EngineArgs.from_kwargs(tiny_checkpoints("tiny-qwen2-vl"), max_model_len=512)
    config = args.create_engine_config()
    register_processor_family("qwen2_vl", "test_processor_family:RECORDING_FAMILY")
    try:
        processor = InputProcessor(config, Tokenizer.from_pretrained(config.model.path))
    finally:
        register_processor_family("qwen2_vl", "foveal.multimodal.processors.qwen2_vl_family:QWEN2_VL")
    assert processor.family.name == "recording"
    prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>Hi",
              "multi_modal_data": {"image": Image.new("RGB", (56, 56))}}
    features = processor.process("r", prompt, SamplingParams(max_tokens=1)).request.mm_features
    assert EXPANDED == [{"image": 1, "video": 0}] and len(features) == 1
