"""The Gemma 3 family as a `ProcessorFamily`: its image processor, its
mm_processor_kwargs (pan-and-scan), placeholder expansion with the tokenizer,
the planner's arithmetic (the crop count is the dial), and the files a tiny
offline checkpoint ships (preprocessor config, chat template). No video."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foveal.errors import InvalidRequestError
from foveal.multimodal.budget import ProcessorGeometry
from foveal.multimodal.processors.family import NoVideoProcessor, ProcessorFamily
from foveal.multimodal.processors.gemma3 import OVERRIDE_KEYS, Gemma3ImageProcessor, gemma3_expander


class Gemma3NoVideoProcessor(NoVideoProcessor):
    family_name = "Gemma 3"


@dataclass(frozen=True)
class Gemma3Geometry(ProcessorGeometry):
    """One fixed view, plus the crops pan-and-scan takes within the planner's max_pixels
    (view area per crop)."""

    def resized_size(self, width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        side = self.processor.image_size
        return side, side


def planner_geometry(image_processor: Gemma3ImageProcessor, video_processor: Any) -> Gemma3Geometry:
    # patch_size: pixels per token side, so detail "low" (a quarter of the tokens' area) asks
    # for about a quarter of the views.
    per_token = int(round((image_processor.image_size ** 2 / image_processor.tokens_per_image) ** 0.5))
    return Gemma3Geometry(patch_size=per_token, merge_size=1, temporal_patch_size=1,
                          image_min_pixels=image_processor.min_pixels,
                          image_max_pixels=image_processor.max_pixels, processor=image_processor)


def _expand_without_tokenizer(token_ids, items_by_modality):
    raise InvalidRequestError("Gemma 3 placeholder expansion needs the tokenizer "
                              "(ProcessorFamily.expander(tokenizer))")


GEMMA3 = ProcessorFamily(
    name="gemma3",
    image_processor_class=Gemma3ImageProcessor,
    video_processor_class=Gemma3NoVideoProcessor,
    image_override_keys=OVERRIDE_KEYS,
    video_override_keys=(),
    expand_placeholders=_expand_without_tokenizer,
    planner_geometry=planner_geometry,
    text_expander=gemma3_expander,
    image_prompt_ids=lambda model_config: (model_config.family_config.boi_token_id,),
)


# Gemma 3 instruct's template with the tiny tokenizer's special tokens standing in
# for Gemma's: <|im_start|> / <|im_end|> for <start_of_turn> / <end_of_turn>,
# <|vision_start|> for <start_of_image>; "model" is the assistant's role; a
# system message prefixes the first user turn.
GEMMA3_TINY_CHAT_TEMPLATE = (
    "{{ '<|endoftext|>' }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% else %}"
    "{% set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' %}"
    "{% endif %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}"
    "{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}"
    "{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|im_start|>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{% if message['content'] is string %}"
    "{{ message['content'] | trim }}"
    "{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "{{ '<|vision_start|>' }}"
    "{% elif item['type'] == 'text' %}"
    "{{ item['text'] | trim }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>model\n' }}{% endif %}"
)


def preprocessor_config(hf_config: dict, do_pan_and_scan: bool = False) -> dict:
    """A preprocessor_config.json body for a checkpoint of this config.json."""
    side = (hf_config.get("vision_config") or {}).get("image_size", 896)
    return {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "size": {"height": side, "width": side}, "image_mean": [0.5] * 3,
            "image_std": [0.5] * 3, "rescale_factor": 1 / 255, "resample": 2, "do_resize": True,
            "do_rescale": True, "do_normalize": True, "do_convert_rgb": None,
            "do_pan_and_scan": do_pan_and_scan, "pan_and_scan_min_crop_size": 256,
            "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2,
            "image_seq_length": hf_config.get("mm_tokens_per_image", 256)}


def write_checkpoint_files(folder: Path, hf_config: dict) -> None:
    """The preprocessor config and the chat template of a tiny offline checkpoint."""
    def write(name: str, body: dict) -> None:
        (folder / name).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")

    write("preprocessor_config.json", preprocessor_config(hf_config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    write("tokenizer_config.json", {**tokenizer_config, "chat_template": GEMMA3_TINY_CHAT_TEMPLATE})
    (folder / "chat_template.jinja").write_text(GEMMA3_TINY_CHAT_TEMPLATE, encoding="utf-8")
