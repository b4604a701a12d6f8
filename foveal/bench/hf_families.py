"""What the transformers baseline needs per model family: transformers' model
class, its PIL image processor, and the image inputs `generate()` takes besides
input_ids and attention_mask.

Prompts reach transformers already expanded (Foveal's placeholder expansion,
checked token for token against transformers' processors by the processor
tests); the image tensors come from transformers' own image processors, inside
the timed region.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from PIL import Image

# rows' images (one list per prompt in the batch), the image processor, the padded
# input_ids and attention_mask, the image token id -> generate() kwargs
InputsBuilder = Callable[[Sequence[Sequence[Image.Image]], object, torch.Tensor, torch.Tensor, int],
                         dict]


@dataclass(frozen=True)
class HFFamily:
    model_class: str  # transformers class name
    image_processor: str  # "module:Class" of transformers' PIL image processor
    image_inputs: InputsBuilder
    takes_mm_kwargs: bool = False  # mm_processor_kwargs (min/max_pixels) go to the processor

    def load_image_processor(self, model_dir, mm_processor_kwargs: dict | None):
        module, name = self.image_processor.split(":")
        cls = getattr(importlib.import_module(module), name)
        kwargs = dict(mm_processor_kwargs or {}) if self.takes_mm_kwargs else {}
        return cls.from_pretrained(model_dir, **kwargs)


def _flat(rows: Sequence[Sequence[Image.Image]]) -> list[Image.Image]:
    return [image for row in rows for image in row]


def _marked(input_ids: torch.Tensor, mask: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """1 on image tokens, 0 on text and padding."""
    return ((input_ids == image_token_id) & mask.bool()).int()


def _qwen(rows, processor, input_ids, mask, image_token_id) -> dict:
    # Without mm_token_type_ids transformers silently falls back to 1-D positions.
    inputs = {"mm_token_type_ids": _marked(input_ids, mask, image_token_id)}
    images = _flat(rows)
    if images:
        out = processor(images=images, return_tensors="pt")
        inputs.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    return inputs


def _llava(with_sizes: bool, per_prompt: bool) -> InputsBuilder:
    def build(rows, processor, input_ids, mask, image_token_id) -> dict:
        images = _flat(rows)
        if not images:
            return {}
        # OneVision: images grouped by prompt; a prompt of several takes the multi-image mode
        out = processor(images=[list(row) for row in rows if row] if per_prompt else images,
                        return_tensors="pt")
        inputs = {"pixel_values": out["pixel_values"]}
        if with_sizes:
            inputs["image_sizes"] = out["image_sizes"]
        if per_prompt:
            inputs["batch_num_images"] = out["batch_num_images"]
        return inputs
    return build


def _gemma3(rows, processor, input_ids, mask, image_token_id) -> dict:
    # token_type_ids mark the image tokens, which attend to each other both ways
    inputs = {"token_type_ids": _marked(input_ids, mask, image_token_id)}
    images = _flat(rows)
    if images:
        inputs["pixel_values"] = processor(images=images, return_tensors="pt")["pixel_values"]
    return inputs


def _idefics3(rows, processor, input_ids, mask, image_token_id) -> dict:
    if not any(rows):
        return {}
    if not all(rows):
        raise ValueError("an Idefics3 batch needs images in every prompt or in none")
    out = processor(images=[list(row) for row in rows], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"]}


_QWEN_PROCESSOR = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:Qwen2VLImageProcessorPil"
_NEXT = "transformers.models.llava_next.image_processing_pil_llava_next:LlavaNextImageProcessorPil"
_ONEVISION = ("transformers.models.llava_onevision.image_processing_pil_llava_onevision:"
              "LlavaOnevisionImageProcessorPil")

# config.json model_type -> the family's transformers side
HF_FAMILIES = {
    "qwen2_vl": HFFamily("Qwen2VLForConditionalGeneration", _QWEN_PROCESSOR, _qwen, True),
    "qwen2_5_vl": HFFamily("Qwen2_5_VLForConditionalGeneration", _QWEN_PROCESSOR, _qwen, True),
    "qwen3_vl": HFFamily("Qwen3VLForConditionalGeneration", _QWEN_PROCESSOR, _qwen, True),
    "qwen3_vl_moe": HFFamily("Qwen3VLMoeForConditionalGeneration", _QWEN_PROCESSOR, _qwen, True),
    "llava": HFFamily("LlavaForConditionalGeneration", "transformers:CLIPImageProcessorPil",
                      _llava(with_sizes=False, per_prompt=False)),
    "llava_next": HFFamily("LlavaNextForConditionalGeneration", _NEXT,
                           _llava(with_sizes=True, per_prompt=False)),
    "llava_onevision": HFFamily("LlavaOnevisionForConditionalGeneration", _ONEVISION,
                                _llava(with_sizes=True, per_prompt=True)),
    "gemma3": HFFamily("Gemma3ForConditionalGeneration",
                       "transformers.models.gemma3.image_processing_pil_gemma3:Gemma3ImageProcessorPil",
                       _gemma3),
    "idefics3": HFFamily("Idefics3ForConditionalGeneration",
                         "transformers.models.idefics3.image_processing_pil_idefics3:"
                         "Idefics3ImageProcessorPil", _idefics3),
    "smolvlm": HFFamily("SmolVLMForConditionalGeneration",
                        "transformers.models.smolvlm.image_processing_pil_smolvlm:SmolVLMImageProcessorPil",
                        _idefics3),
}
