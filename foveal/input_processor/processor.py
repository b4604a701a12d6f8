"""InputProcessor: one prompt -> one engine Request. It ties the steps
together: validate (prompt.py), load media (media.py), plan the visual-token
budget (planning.py), process each item with the model family's processors,
add videos' transcripts, expand placeholders, check the length."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from foveal.config import EngineConfig
from foveal.engine.request import Request
from foveal.errors import ContextLengthError, InvalidRequestError
from foveal.input_processor.media import MediaLoader, PromptMedia
from foveal.input_processor.planning import in_prompt_order, plan_prompt_media
from foveal.input_processor.prompt import (ProcessorKwargs, PromptType, check_token_ids, has_video,
                                           split_processor_kwargs, validated_prompt)
from foveal.multimodal.budget import ItemPlan
from foveal.multimodal.media.audio_track import speech_wav
from foveal.multimodal.media.video import load_video
from foveal.multimodal.processor_cache import ProcessorCache
from foveal.multimodal.processors import get_processor_family
from foveal.multimodal.transcriber import Transcriber, get_transcriber, insert_transcripts, transcribe_video
from foveal.sampling_params import SamplingParams
from foveal.tokenizer import Tokenizer


@dataclass
class ProcessedPrompt:
    request: Request
    text: str | None  # the prompt text; None for token ids
    mm_plan: list[ItemPlan]  # the planner's choice per media item, in prompt order


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer,
                 transcriber: Transcriber | None = None) -> None:
        """transcriber: transcribes videos' audio tracks inside `process` (default:
        the LLM-level mm_processor_kwargs "transcriber", else none: the caller
        brings transcripts made by its speech-to-text stage)."""
        self.config = config
        self.tokenizer = tokenizer
        self.family = get_processor_family(config.model.model_type)
        self.expand_placeholders = self.family.expander(tokenizer)
        kwargs = dict(config.multimodal.mm_processor_kwargs)
        name = kwargs.pop("transcriber", None)
        self.transcriber = transcriber or (get_transcriber(name) if name else None)
        defaults = self._split_kwargs(kwargs)
        self.max_visual_tokens = defaults.max_visual_tokens
        self.transcribe_audio = defaults.transcribe_audio is not False
        path = config.model.path
        self.image_processor = self.family.image_processor_class.from_pretrained(path, defaults.image)
        self.video_processor = self.family.video_processor_class.from_pretrained(path, defaults.video)
        self.processor_cache = ProcessorCache(config.multimodal.processor_cache_size)
        self.media = MediaLoader(self.processor_cache, config.multimodal.max_image_pixels,
                                 config.multimodal.limit_mm_per_prompt)

    def get_metrics(self) -> dict[str, float]:
        return self.processor_cache.get_metrics()

    def video_speech(self, prompt: PromptType) -> list[bytes | None] | None:
        """Each video's audio track as a 16 kHz WAV for a speech-to-text stage
        (None for a video without an audio track or with a silent one); the
        caller turns them into `process(..., transcripts=...)`.

        None when nothing is to be transcribed that way: no videos,
        transcribe_audio=false, or a configured transcriber (it runs inside
        `process`). Videos are probed first: one over a limit fails here,
        before any speech-to-text work. Raises InvalidRequestError.
        """
        prompt = validated_prompt(prompt)
        kwargs = self._split_kwargs(prompt.get("mm_processor_kwargs") or {})
        if self.transcriber is not None or not self._transcribes(kwargs) or not has_video(prompt):
            return None
        video_processor = self._video_processor(prompt, kwargs)
        videos = self.media.load_videos(prompt.get("multi_modal_data") or {}, video_processor.sampling)
        return [speech_wav(video) for video in videos]

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                transcripts: Sequence[str | None] | None = None) -> ProcessedPrompt:
        """Validate, tokenize and process one prompt; raises InvalidRequestError.

        transcripts: one marked transcript or None per video (from
        `video_speech`), each put right after its video.
        """
        prompt = validated_prompt(prompt)
        text, token_ids = self._tokenize(prompt)
        check_token_ids(token_ids, params.stop_token_ids, self.config.model.text.vocab_size)
        kwargs = self._split_kwargs(prompt.get("mm_processor_kwargs") or {})
        image_processor = self.image_processor.with_overrides(kwargs.image) if kwargs.image \
            else self.image_processor
        video_processor = self._video_processor(prompt, kwargs)
        media = self.media.load(prompt.get("multi_modal_data") or {},
                                prompt.get("multi_modal_uuids") or {}, video_processor.sampling)
        image_processor = self.family.image_processor_for_prompt(image_processor, len(media.images))
        plan = plan_prompt_media(media, self.family.planner_geometry(image_processor, video_processor),
                                 video_processor.sampling, kwargs.max_visual_tokens or self.max_visual_tokens)
        image_plans, video_plans = plan[:len(media.images)], plan[len(media.images):]
        items = self._process_media(media, image_plans, video_plans, image_processor, video_processor)
        token_ids = self._add_transcripts(token_ids, media.videos, kwargs, transcripts)
        model = self.config.model
        token_ids, features = self.expand_placeholders(
            token_ids, {"image": (model.image_token_id, items[0]), "video": (model.video_token_id, items[1])})
        self._check_length(token_ids, features)
        request = Request(request_id, token_ids, features, self._finalize(params, token_ids),
                          arrival_time=time.time(), cache_salt=prompt.get("cache_salt"))
        return ProcessedPrompt(request, text, in_prompt_order(features, image_plans, video_plans))

    def _video_processor(self, prompt: Mapping[str, Any], kwargs: ProcessorKwargs):
        """The prompt's video processor; a family without video refuses a video here,
        before it is fetched or decoded."""
        video_processor = self.video_processor.with_overrides(kwargs.video)
        if has_video(prompt) and not getattr(video_processor, "takes_video", True):
            raise InvalidRequestError(video_processor.refusal())
        return video_processor

    def _split_kwargs(self, kwargs: Mapping[str, Any]) -> ProcessorKwargs:
        return split_processor_kwargs(kwargs, self.family.image_override_keys,
                                      self.family.video_override_keys)

    def _transcribes(self, kwargs: ProcessorKwargs) -> bool:
        return self.transcribe_audio if kwargs.transcribe_audio is None else kwargs.transcribe_audio

    def _tokenize(self, prompt: Mapping[str, Any]) -> tuple[str | None, list[int]]:
        if "prompt_token_ids" in prompt:
            token_ids = [int(t) for t in prompt["prompt_token_ids"]]
            return prompt.get("prompt"), token_ids
        if "prompt" not in prompt:
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        text = prompt["prompt"]
        return text, self.tokenizer.encode(text)

    def _process_media(self, media: PromptMedia, image_plans: list[ItemPlan], video_plans: list[ItemPlan],
                       image_processor, video_processor) -> tuple[list, list]:
        """(processed images, processed videos), each at its planned size and frame count."""
        images = [self.media.process_image(image, image_processor.with_overrides(
                  {"max_pixels": p.max_pixels})) for image, p in zip(media.images, image_plans)]
        videos = [video_processor.with_max_pixels(p.max_pixels).process(
                  load_video(source, info, p.num_frames, video_processor.sampling))
                  for source, info, p in zip(media.videos, media.video_infos, video_plans)]
        return images, videos

    def _add_transcripts(self, token_ids: list[int], videos: list, kwargs: ProcessorKwargs,
                         transcripts: Sequence[str | None] | None) -> list[int]:
        if not videos or not self._transcribes(kwargs):
            return token_ids
        if transcripts is None and self.transcriber is not None:
            transcripts = [transcribe_video(self.transcriber, video, index + 1)
                           for index, video in enumerate(videos)]
        if transcripts is None:
            return token_ids
        if len(transcripts) != len(videos):
            raise InvalidRequestError(f"got {len(transcripts)} transcripts for {len(videos)} videos; "
                                      "pass one (or None) per video, from video_speech()")
        encoded = [self.tokenizer.encode(t) if t else [] for t in transcripts]
        model = self.config.model
        return insert_transcripts(token_ids, encoded, model.video_token_id, model.vision_end_token_id)

    def _check_length(self, token_ids: list[int], features: list) -> None:
        max_len = self.config.scheduler.max_model_len
        if len(token_ids) >= max_len:
            visual = sum(f.placeholder.length for f in features)
            raise ContextLengthError(
                f"prompt is {len(token_ids)} tokens ({visual} of them visual); "
                f"max_model_len is {max_len}: shorten the prompt, lower the media resolution or "
                f"frame count (mm_processor_kwargs max_pixels / fps / max_visual_tokens) or "
                f"raise --max-model-len")

    def _finalize(self, params: SamplingParams, token_ids: list[int]) -> SamplingParams:
        room = self.config.scheduler.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return replace(params, max_tokens=max_tokens,
                       eos_token_ids=tuple(self.config.model.eos_token_ids))
