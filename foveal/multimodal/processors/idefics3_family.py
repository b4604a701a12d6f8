"""The Idefics3 / SmolVLM families as `ProcessorFamily` objects: the image
processor, its mm_processor_kwargs, placeholder expansion with the tokenizer
(tile markers; SmolVLM videos' frame prompts), the planner's arithmetic (the
tile count is the dial for images, the frame count for videos), and the files
a tiny offline checkpoint ships. Idefics3 refuses videos with a clear error."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foveal.errors import InvalidRequestError
from foveal.multimodal.budget import ProcessorGeometry
from foveal.multimodal.processors.family import NoVideoProcessor, ProcessorFamily
from foveal.multimodal.processors.idefics3 import OVERRIDE_KEYS, Idefics3ImageProcessor, idefics3_expander
from foveal.multimodal.processors.smolvlm_video import OVERRIDE_KEYS as VIDEO_KEYS
from foveal.multimodal.processors.smolvlm_video import SmolVLMVideoProcessor


class Idefics3NoVideoProcessor(NoVideoProcessor):
    family_name = "Idefics3 / SmolVLM"


@dataclass(frozen=True)
class Idefics3Geometry(ProcessorGeometry):
    """(tiles + 1) * image_seq_len, the tiles those of the longest edge max_pixels allows;
    a SmolVLM video: image_seq_len per frame at any size."""

    video_processor: SmolVLMVideoProcessor | None = None

    def video_tokens(self, width: int, height: int, num_frames: int, min_pixels: int,
                     max_pixels: int) -> int:
        video = self.video_processor
        return video.num_tokens(num_frames) if video is not None and video.takes_video else 0

    def resized_size(self, width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        _, _, resized_h, resized_w = self.at(max_pixels).grid(width, height)
        return resized_h, resized_w


def planner_geometry(image_processor: Idefics3ImageProcessor, video_processor: Any) -> Idefics3Geometry:
    # patch_size: pixels per token side, so detail "low" (a quarter of the tokens' area) asks
    # for about a quarter of the tiles. Video frames have one size: the planner drops frames only.
    per_token = int(round((image_processor.tile_size ** 2 / image_processor.image_seq_len) ** 0.5))
    frame_area = image_processor.min_pixels
    videos = video_processor if isinstance(video_processor, SmolVLMVideoProcessor) else None
    return Idefics3Geometry(patch_size=per_token, merge_size=1, temporal_patch_size=1,
                            image_min_pixels=image_processor.min_pixels,
                            image_max_pixels=image_processor.max_pixels,
                            video_min_pixels=frame_area, video_max_pixels=frame_area, min_frames=1,
                            processor=image_processor, video_processor=videos)


def _expand_without_tokenizer(token_ids, items_by_modality):
    raise InvalidRequestError("Idefics3 placeholder expansion needs the tokenizer "
                              "(ProcessorFamily.expander(tokenizer))")


IDEFICS3 = ProcessorFamily(
    name="idefics3",
    image_processor_class=Idefics3ImageProcessor,
    video_processor_class=Idefics3NoVideoProcessor,
    image_override_keys=OVERRIDE_KEYS,
    video_override_keys=(),
    expand_placeholders=_expand_without_tokenizer,
    planner_geometry=planner_geometry,
    text_expander=idefics3_expander,
)
SMOLVLM = dataclasses.replace(IDEFICS3, name="smolvlm", video_processor_class=SmolVLMVideoProcessor,
                              video_override_keys=tuple(VIDEO_KEYS))

# The Idefics3 / SmolVLM "User:<image>...<end_of_utterance>\nAssistant:" layout with the tiny
# tokenizer's specials: <|endoftext|> for <|begin_of_text|>, <|im_end|> for <end_of_utterance>,
# <|image_pad|> for <image>, <|video_pad|> for <video>.
IDEFICS3_TINY_CHAT_TEMPLATE = (
    "{{ '<|endoftext|>' }}"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}"
    "{% set first = message['content'][0] %}"
    "{% if first['type'] == 'image' or 'image' in first or 'image_url' in first %}{{ ':' }}"
    "{% else %}{{ ': ' }}{% endif %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}{{ '<|image_pad|>' }}"
    "{% elif item['type'] == 'video' or 'video' in item %}{{ '<|video_pad|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# Tiny checkpoints' stand-ins for the marker tokens (special tokens of the tiny tokenizer).
TINY_VIDEO_TOKEN = "<|video_pad|>"  # SmolVLM's "<video>"
TINY_MARKERS = {"image_token": "<|image_pad|>", "fake_image_token": "<|vision_start|>",
                "global_image_token": "<|vision_end|>"}


def preprocessor_config(hf_config: dict) -> dict:
    """A preprocessor_config.json body for a tiny / dummy checkpoint of this config.json
    (longest edge: 2 tiles for tiny towers, 4 as the hub checkpoints for real ones)."""
    side = (hf_config.get("vision_config") or {}).get("image_size", 364)
    tiles_per_side = 2 if side < 256 else 4
    smolvlm = hf_config.get("model_type") == "smolvlm"
    body = {"image_processor_type": "SmolVLMImageProcessor" if smolvlm else "Idefics3ImageProcessor",
            "do_convert_rgb": True, "do_resize": True,
            "size": {"longest_edge": side * tiles_per_side}, "max_image_size": {"longest_edge": side},
            "resample": 1, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_image_splitting": True,
            "do_pad": True, **TINY_MARKERS}
    if smolvlm:  # SmolVLM2's video settings (one frame a second, up to 64)
        body.update(video_token=TINY_VIDEO_TOKEN, video_sampling={
            "fps": 1, "max_frames": 64, "video_size": {"longest_edge": side * tiles_per_side}})
    return body


def write_checkpoint_files(folder: Path, hf_config: dict) -> None:
    """The preprocessor config and the chat template of a tiny offline checkpoint."""
    def write(name: str, body: dict) -> None:
        (folder / name).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")

    write("preprocessor_config.json", preprocessor_config(hf_config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    write("tokenizer_config.json", {**tokenizer_config, "chat_template": IDEFICS3_TINY_CHAT_TEMPLATE})
    (folder / "chat_template.jinja").write_text(IDEFICS3_TINY_CHAT_TEMPLATE, encoding="utf-8")
