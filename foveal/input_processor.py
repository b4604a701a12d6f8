"""Prompt -> engine Request: tokenize, load and process media, expand
placeholders, and check every limit before the engine sees the request."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Mapping, Union

from foveal.config import EngineConfig
from foveal.engine.request import Request
from foveal.errors import ContextLengthError, InvalidRequestError, MediaError, MediaLimitError
from foveal.multimodal.media.image import load_image
from foveal.multimodal.processors import get_image_processor_class
from foveal.multimodal.processors.qwen2_vl import expand_placeholders
from foveal.sampling_params import SamplingParams
from foveal.tokenizer import Tokenizer

PromptType = Union[str, Mapping[str, Any]]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs",
                "cache_salt"}


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        processor_class = get_image_processor_class(config.model.model_type)
        self.image_processor = processor_class.from_pretrained(
            config.model.path, config.multimodal.mm_processor_kwargs)

    def _image_processor(self, overrides: Mapping[str, Any]):
        return self.image_processor.with_overrides(dict(overrides)) if overrides \
            else self.image_processor

    def process(self, request_id: str, prompt: PromptType,
                params: SamplingParams) -> tuple[Request, str | None]:
        """Returns the engine request and the prompt text (None for token ids)."""
        prompt = {"prompt": prompt} if isinstance(prompt, str) else prompt
        if not isinstance(prompt, Mapping):
            raise InvalidRequestError(
                f"a prompt is a str or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise InvalidRequestError(
                f"unknown prompt key(s) {sorted(unknown)}; accepted: {sorted(_PROMPT_KEYS)}")
        text, token_ids = self._tokenize(prompt)
        images = self._load_images(prompt.get("multi_modal_data") or {})
        processor = self._image_processor(prompt.get("mm_processor_kwargs") or {})
        processed = [processor.process(image) for image in images]
        token_ids, features = expand_placeholders(
            token_ids, processed, self.config.model.image_token_id)
        self._check_length(token_ids, features)
        request = Request(request_id, token_ids, features, self._finalize(params, token_ids),
                          arrival_time=time.time(), cache_salt=prompt.get("cache_salt"))
        return request, text

    def _tokenize(self, prompt: Mapping[str, Any]) -> tuple[str | None, list[int]]:
        if "prompt_token_ids" in prompt:
            token_ids = [int(t) for t in prompt["prompt_token_ids"]]
            return prompt.get("prompt"), token_ids
        if "prompt" not in prompt:
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        text = prompt["prompt"]
        return text, self.tokenizer.encode(text)

    def _load_images(self, mm_data: Mapping[str, Any]) -> list:
        for modality in mm_data:
            if modality != "image":
                raise MediaError(f"multi_modal_data[{modality!r}] is not supported yet; "
                                 f"this engine takes 'image'")
        images = mm_data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        limit = self.config.multimodal.limit_mm_per_prompt.get("image", 0)
        if len(images) > limit:
            raise MediaLimitError(
                f"prompt has {len(images)} images; the limit is {limit} "
                f"(limit_mm_per_prompt={{'image': N}} / --limit-mm-per-prompt)")
        max_pixels = self.config.multimodal.max_image_pixels
        return [load_image(image, max_pixels) for image in images]

    def _check_length(self, token_ids: list[int], features: list) -> None:
        max_len = self.config.scheduler.max_model_len
        if len(token_ids) >= max_len:
            visual = sum(f.placeholder.length for f in features)
            raise ContextLengthError(
                f"prompt is {len(token_ids)} tokens ({visual} of them visual); "
                f"max_model_len is {max_len}: shorten the prompt, lower the image "
                f"resolution (mm_processor_kwargs max_pixels) or raise --max-model-len")

    def _finalize(self, params: SamplingParams, token_ids: list[int]) -> SamplingParams:
        room = self.config.scheduler.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return replace(params, max_tokens=max_tokens,
                       eos_token_ids=tuple(self.config.model.eos_token_ids))
