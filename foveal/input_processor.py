"""Prompt -> engine Request: tokenize, load media, plan the visual-token budget,
process, expand placeholders, and check every limit before the engine sees it.

multi_modal_data: {"image": item | [items], "video": item | [items]}
  image item: a source `load_image` takes, or {"image": source, "detail": "low"|"high"|"auto"}
  video item: a source `load_video` takes (path, file:// / data: URL, bytes, a list of
              frames, a (T, H, W, 3) array or {"frames": [...], "fps": 4.0})
multi_modal_uuids: {"image": ["id1", None, ...]} parallel to multi_modal_data: a
  client-given id names an image (the same id must always mean the same image).
  A repeat is served from the processor cache without decoding; an entry whose
  data is None is served from the cache alone, or fails if the id is unknown.
  Video ids are not supported yet.
cache_salt: a string folded into the first KV block's prefix hash; requests with
  different salts never share prefix-cache KV (per-tenant isolation).
mm_processor_kwargs (per LLM, overridden per prompt): min_pixels / max_pixels (images),
  video_min_pixels / video_max_pixels / fps / min_frames / max_frames (videos),
  max_visual_tokens (the planner's budget; foveal.multimodal.budget), and per LLM
  only, transcriber (a registered `Transcriber` name).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Union

import numpy as np
from PIL import Image

from foveal.config import EngineConfig
from foveal.engine.request import Request
from foveal.errors import ContextLengthError, InvalidRequestError, MediaError, MediaLimitError
from foveal.multimodal.budget import Geometry, ImageItem, ItemPlan, VideoItem, plan_media
from foveal.multimodal.media.image import load_image
from foveal.multimodal.hashing import hash_image
from foveal.multimodal.media.video import VideoInfo, load_video, probe_video
from foveal.multimodal.processor_cache import ProcessorCache, processing_key, source_content_id
from foveal.multimodal.processors import get_image_processor_class, get_video_processor_class
from foveal.multimodal.processors.qwen2_vl import OVERRIDE_KEYS as IMAGE_KEYS, expand_mm_placeholders
from foveal.multimodal.processors.qwen2_vl_video import OVERRIDE_KEYS as VIDEO_KEYS, Qwen2VLVideoProcessor
from foveal.multimodal.transcriber import Transcriber, get_transcriber, insert_transcripts, transcribe_video
from foveal.sampling_params import SamplingParams
from foveal.tokenizer import Tokenizer

PromptType = Union[str, Mapping[str, Any]]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs",
                "cache_salt", "multi_modal_uuids"}
_MODALITIES = ("image", "video")
_PLANNER_KEYS = ("max_visual_tokens",)
_LLM_ONLY_KEYS = ("transcriber",)


@dataclass
class ProcessedPrompt:
    request: Request
    text: str | None  # the prompt text; None for token ids
    mm_plan: list[ItemPlan]  # the planner's choice per media item, in prompt order


@dataclass
class _ImageInput:
    """One image before processing; decoded only when the processor cache misses."""

    source: Any  # None when only a multi_modal_uuid names it
    content_id: str | None  # processor-cache identity; None: not cacheable
    width: int
    height: int
    detail: str
    decoded: Image.Image | None = None


@dataclass
class _Media:
    images: list[_ImageInput]
    videos: list  # sources
    video_infos: list[VideoInfo]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer,
                 transcriber: Transcriber | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        kwargs = dict(config.multimodal.mm_processor_kwargs)
        name = kwargs.pop("transcriber", None)
        self.transcriber = transcriber or (get_transcriber(name) if name else None)
        image_kwargs, video_kwargs, self.max_visual_tokens = _split_kwargs(kwargs)
        processor_class = get_image_processor_class(config.model.model_type)
        self.image_processor = processor_class.from_pretrained(config.model.path, image_kwargs)
        video_class = get_video_processor_class(config.model.model_type)
        self.video_processor = video_class.from_pretrained(config.model.path, video_kwargs)
        self.processor_cache = ProcessorCache(config.multimodal.processor_cache_size)

    def get_metrics(self) -> dict[str, float]:
        return self.processor_cache.get_metrics()

    def process(self, request_id: str, prompt: PromptType,
                params: SamplingParams) -> ProcessedPrompt:
        """Validate, tokenize and process one prompt; raises InvalidRequestError."""
        prompt = _validated(prompt)
        text, token_ids = self._tokenize(prompt)
        self._check_token_ids(token_ids, params)
        image_kwargs, video_kwargs, budget = _split_kwargs(prompt.get("mm_processor_kwargs") or {})
        image_processor = self.image_processor.with_overrides(image_kwargs) if image_kwargs \
            else self.image_processor
        video_processor = self.video_processor.with_overrides(video_kwargs)
        media = self._load_media(prompt.get("multi_modal_data") or {},
                                 prompt.get("multi_modal_uuids") or {}, video_processor)
        plan = self._plan(media, image_processor, video_processor, budget or self.max_visual_tokens)
        image_plans, video_plans = plan[:len(media.images)], plan[len(media.images):]
        images = [self._process_image(image, image_processor.with_overrides({"max_pixels": p.max_pixels}))
                  for image, p in zip(media.images, image_plans)]
        videos = [video_processor.with_max_pixels(p.max_pixels).process(
                  load_video(source, info, p.num_frames, video_processor.sampling))
                  for source, info, p in zip(media.videos, media.video_infos, video_plans)]
        token_ids = self._add_transcripts(token_ids, media.videos)
        model = self.config.model
        token_ids, features = expand_mm_placeholders(
            token_ids, {"image": (model.image_token_id, images), "video": (model.video_token_id, videos)})
        self._check_length(token_ids, features)
        request = Request(request_id, token_ids, features, self._finalize(params, token_ids),
                          arrival_time=time.time(), cache_salt=prompt.get("cache_salt"))
        return ProcessedPrompt(request, text, _in_prompt_order(features, image_plans, video_plans))

    def _tokenize(self, prompt: Mapping[str, Any]) -> tuple[str | None, list[int]]:
        if "prompt_token_ids" in prompt:
            token_ids = [int(t) for t in prompt["prompt_token_ids"]]
            return prompt.get("prompt"), token_ids
        if "prompt" not in prompt:
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        text = prompt["prompt"]
        return text, self.tokenizer.encode(text)

    def _check_token_ids(self, token_ids: list[int], params: SamplingParams) -> None:
        """Ids outside the vocabulary would crash the embedding lookup for the whole batch."""
        vocab_size = self.config.model.text.vocab_size
        for name, ids in (("prompt_token_ids", token_ids), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"{name} holds {bad[:5]}, outside the vocabulary "
                                          f"[0, {vocab_size})")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token")

    def _load_media(self, mm_data: Mapping[str, Any], mm_uuids: Mapping[str, Any],
                    video_processor: Qwen2VLVideoProcessor) -> _Media:
        for modality in mm_data:
            if modality not in _MODALITIES:
                raise MediaError(f"multi_modal_data[{modality!r}] is not supported; "
                                 f"this engine takes {list(_MODALITIES)}")
        image_items = [_image_item(item) for item in self._items(mm_data, "image")]
        videos = self._items(mm_data, "video")
        uuids = _uuids(mm_uuids, {"image": len(image_items), "video": len(videos)})
        images = [self._image_input(index, source, detail, uuid)
                  for index, ((source, detail), uuid) in enumerate(zip(image_items, uuids["image"]))]
        max_pixels = self.config.multimodal.max_image_pixels
        infos = [probe_video(v, video_processor.sampling, max_pixels) for v in videos]
        return _Media(images, videos, infos)

    def _image_input(self, index: int, source: Any, detail: str, uuid: str | None) -> _ImageInput:
        """Identify an image and learn its size, decoding only what the cache has not seen."""
        decoded = None
        if uuid is not None:
            content_id = f"uuid:{uuid}"
        elif isinstance(source, Image.Image):
            decoded = load_image(source, self.config.multimodal.max_image_pixels)
            content_id = "pixels:" + hash_image(decoded)
        else:
            content_id = source_content_id(source)
        size = self.processor_cache.size_of(content_id) if content_id else None
        if size is None:
            if source is None:
                raise InvalidRequestError(
                    f"image {index}: unknown multi_modal_uuid {uuid!r} and no data; send the "
                    "media again" if uuid is not None else
                    f"image {index} is None; send the image or a multi_modal_uuid sent before")
            decoded = decoded or load_image(source, self.config.multimodal.max_image_pixels)
            size = decoded.size
            if content_id:
                self.processor_cache.remember_size(content_id, *size)
        return _ImageInput(source, content_id, size[0], size[1], detail, decoded)

    def _process_image(self, image: _ImageInput, processor) -> Any:
        """Processed image from the cache, or decode and process it and keep the result."""
        key = processing_key(image.content_id, processor.tensor_params()) if image.content_id else None
        cached = self.processor_cache.get(key) if key else None
        if cached is not None:
            return cached
        if image.decoded is None:
            if image.source is None:
                raise InvalidRequestError(
                    f"multi_modal_uuid {image.content_id[len('uuid:'):]!r} is cached only with other "
                    "processing parameters (max_pixels, detail, ...); send the media again")
            image.decoded = load_image(image.source, self.config.multimodal.max_image_pixels)
        processed = processor.process(image.decoded)
        if key:
            self.processor_cache.put(key, processed, processed.pixel_values.nbytes)
        return processed

    def _items(self, mm_data: Mapping[str, Any], modality: str) -> list:
        items = mm_data.get(modality, [])
        if not isinstance(items, (list, tuple)) or (modality == "video" and _is_one_frame_list(items)):
            items = [items]
        limit = self.config.multimodal.limit_mm_per_prompt.get(modality, 0)
        if len(items) > limit:
            raise MediaLimitError(
                f"prompt has {len(items)} {modality}s; the limit is {limit} "
                f"(limit_mm_per_prompt={{'{modality}': N}} / --limit-mm-per-prompt)")
        return list(items)

    def _plan(self, media: _Media, image_processor, video_processor: Qwen2VLVideoProcessor,
              budget: int | None) -> list[ItemPlan]:
        frame = video_processor.frame
        geometry = Geometry(
            patch_size=frame.patch_size, merge_size=frame.merge_size,
            temporal_patch_size=frame.temporal_patch_size,
            image_min_pixels=image_processor.min_pixels, image_max_pixels=image_processor.max_pixels,
            video_min_pixels=frame.min_pixels, video_max_pixels=frame.max_pixels,
            min_frames=video_processor.min_frames)
        sampling = video_processor.sampling
        items = [ImageItem(image.width, image.height, image.detail) for image in media.images]
        items += [VideoItem(info.width, info.height, sampling.num_frames(info.num_frames, info.fps))
                  for info in media.video_infos]
        return list(plan_media(items, geometry, budget).items)

    def _add_transcripts(self, token_ids: list[int], videos: list) -> list[int]:
        if self.transcriber is None or not videos:
            return token_ids
        transcripts = [transcribe_video(self.transcriber, video, index + 1)
                       for index, video in enumerate(videos)]
        model = self.config.model
        encoded = [self.tokenizer.encode(t) if t else [] for t in transcripts]
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


def _validated(prompt: PromptType) -> Mapping[str, Any]:
    prompt = {"prompt": prompt} if isinstance(prompt, str) else prompt
    if not isinstance(prompt, Mapping):
        raise InvalidRequestError(f"a prompt is a str or a dict, got {type(prompt).__name__}")
    unknown = set(prompt) - _PROMPT_KEYS
    if unknown:
        raise InvalidRequestError(
            f"unknown prompt key(s) {sorted(unknown)}; accepted: {sorted(_PROMPT_KEYS)}")
    return prompt


def _split_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict, dict, int | None]:
    """mm_processor_kwargs -> (image processor keys, video processor keys, max_visual_tokens)."""
    accepted = (*IMAGE_KEYS, *VIDEO_KEYS, *_PLANNER_KEYS)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        hint = " (transcriber is set per LLM, not per prompt)" if set(unknown) & set(_LLM_ONLY_KEYS) else ""
        raise InvalidRequestError(f"unknown mm_processor_kwargs {unknown}{hint}; accepted: {sorted(accepted)}")
    image = {k: v for k, v in kwargs.items() if k in IMAGE_KEYS}
    video = {k: v for k, v in kwargs.items() if k in VIDEO_KEYS}
    budget = kwargs.get("max_visual_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise InvalidRequestError(f"mm_processor_kwargs['max_visual_tokens'] must be a positive int, "
                                  f"got {budget!r}")
    return image, video, budget


def _uuids(mm_uuids: Mapping[str, Any], counts: dict[str, int]) -> dict[str, list[str | None]]:
    """multi_modal_uuids -> one id or None per item of each modality."""
    if not isinstance(mm_uuids, Mapping) or set(mm_uuids) - set(_MODALITIES):
        raise InvalidRequestError(f"multi_modal_uuids is a dict with keys in {list(_MODALITIES)}, "
                                  f"got {mm_uuids!r:.100}")
    result = {}
    for modality, count in counts.items():
        ids = mm_uuids.get(modality, [None] * count)
        ids = [ids] if isinstance(ids, str) else list(ids)
        if len(ids) != count or not all(i is None or isinstance(i, str) for i in ids):
            raise InvalidRequestError(
                f"multi_modal_uuids[{modality!r}] needs one str or None per {modality} "
                f"({count} in multi_modal_data), got {ids!r:.100}")
        if modality == "video" and any(ids):
            raise InvalidRequestError("multi_modal_uuids for videos are not supported yet; "
                                      "send None for each video")
        result[modality] = ids
    return result


def _is_one_frame_list(items: Any) -> bool:
    """A list whose elements are frames is one video, not a list of videos."""
    first = items[0] if items else None
    return isinstance(first, Image.Image) or (isinstance(first, np.ndarray) and first.ndim == 3)


def _image_item(item: Any) -> tuple[Any, str]:
    """(source, detail) of an image item: a bare source or {"image": ..., "detail": ...}."""
    if not isinstance(item, dict):
        return item, "auto"
    if "image" not in item or set(item) - {"image", "detail"}:
        raise MediaError(f"an image dict has 'image' and an optional 'detail', got keys {sorted(item)}")
    return item["image"], item.get("detail") or "auto"


def _in_prompt_order(features: list, image_plans: list[ItemPlan],
                     video_plans: list[ItemPlan]) -> list[ItemPlan]:
    queues = {"image": iter(image_plans), "video": iter(video_plans)}
    return [next(queues[feature.modality]) for feature in features]
