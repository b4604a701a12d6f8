"""Checks on a prompt before any media is touched: its keys, its
mm_processor_kwargs, its multi_modal_uuids, its token ids, and the media items
of each modality within the per-prompt limits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Union

import numpy as np
from PIL import Image

from foveal.errors import InvalidRequestError, MediaError, MediaLimitError

PromptType = Union[str, Mapping[str, Any]]
PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs",
               "cache_salt", "multi_modal_uuids"}
MODALITIES = ("image", "video")
_PLANNER_KEYS = ("max_visual_tokens",)
_TRANSCRIPT_KEYS = ("transcribe_audio",)
_LLM_ONLY_KEYS = ("transcriber",)


@dataclass(frozen=True)
class ProcessorKwargs:
    """mm_processor_kwargs split by who reads them; None: not given."""

    image: dict  # image processor overrides
    video: dict  # video processor overrides
    max_visual_tokens: int | None  # the planner's budget
    transcribe_audio: bool | None  # False: videos' audio tracks stay out of the prompt


def validated_prompt(prompt: PromptType) -> Mapping[str, Any]:
    prompt = {"prompt": prompt} if isinstance(prompt, str) else prompt
    if not isinstance(prompt, Mapping):
        raise InvalidRequestError(f"a prompt is a str or a dict, got {type(prompt).__name__}")
    unknown = set(prompt) - PROMPT_KEYS
    if unknown:
        raise InvalidRequestError(
            f"unknown prompt key(s) {sorted(unknown)}; accepted: {sorted(PROMPT_KEYS)}")
    return prompt


def split_processor_kwargs(kwargs: Mapping[str, Any], image_keys: tuple[str, ...],
                           video_keys: tuple[str, ...]) -> ProcessorKwargs:
    """mm_processor_kwargs -> the keys of the image and video processors (the
    family's), the planner's budget and the transcript switch."""
    accepted = (*image_keys, *video_keys, *_PLANNER_KEYS, *_TRANSCRIPT_KEYS)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        hint = " (transcriber is set per LLM, not per prompt)" if set(unknown) & set(_LLM_ONLY_KEYS) else ""
        named = f"{unknown[:5]}" + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
        raise InvalidRequestError(f"unknown mm_processor_kwargs {named}{hint}; accepted: {sorted(accepted)}")
    image = {k: v for k, v in kwargs.items() if k in image_keys}
    video = {k: v for k, v in kwargs.items() if k in video_keys}
    budget = kwargs.get("max_visual_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise InvalidRequestError(f"mm_processor_kwargs['max_visual_tokens'] must be a positive int, "
                                  f"got {budget!r}")
    transcribe = kwargs.get("transcribe_audio")
    if transcribe is not None and not isinstance(transcribe, bool):
        raise InvalidRequestError(f"mm_processor_kwargs['transcribe_audio'] must be true or false, "
                                  f"got {transcribe!r}")
    return ProcessorKwargs(image, video, budget, transcribe)


def check_token_ids(token_ids: list[int], stop_token_ids: list[int], vocab_size: int) -> None:
    """Ids outside the vocabulary would crash the embedding lookup for the whole batch."""
    for name, ids in (("prompt_token_ids", token_ids), ("stop_token_ids", stop_token_ids)):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"{name} holds {bad[:5]}, outside the vocabulary "
                                      f"[0, {vocab_size})")
    if not token_ids:
        raise InvalidRequestError("the prompt is empty; send at least one token")


def check_modalities(mm_data: Mapping[str, Any]) -> None:
    for modality in mm_data:
        if modality not in MODALITIES:
            raise MediaError(f"multi_modal_data[{modality!r}] is not supported; "
                             f"this engine takes {list(MODALITIES)}")


def media_items(mm_data: Mapping[str, Any], modality: str, limit: int) -> list:
    """The items of one modality (a bare item or a list), at most `limit` of them."""
    items = mm_data.get(modality, [])
    if not isinstance(items, (list, tuple)) or (modality == "video" and _is_one_frame_list(items)):
        items = [items]
    if len(items) > limit:
        raise MediaLimitError(
            f"prompt has {len(items)} {modality}s; the limit is {limit} "
            f"(limit_mm_per_prompt={{'{modality}': N}} / --limit-mm-per-prompt)")
    return list(items)


def has_video(prompt: PromptType) -> bool:
    """True when the prompt names at least one video (cheap; nothing is validated)."""
    mm_data = prompt.get("multi_modal_data") if isinstance(prompt, Mapping) else None
    videos = mm_data.get("video") if isinstance(mm_data, Mapping) else None
    return videos is not None and not (isinstance(videos, (list, tuple)) and not videos)


def media_uuids(mm_uuids: Mapping[str, Any], counts: dict[str, int]) -> dict[str, list[str | None]]:
    """multi_modal_uuids -> one id or None per item of each modality."""
    if not isinstance(mm_uuids, Mapping) or set(mm_uuids) - set(MODALITIES):
        raise InvalidRequestError(f"multi_modal_uuids is a dict with keys in {list(MODALITIES)}, "
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


def image_item(item: Any) -> tuple[Any, str]:
    """(source, detail) of an image item: a bare source or {"image": ..., "detail": ...}."""
    if not isinstance(item, dict):
        return item, "auto"
    if "image" not in item or set(item) - {"image", "detail"}:
        raise MediaError(f"an image dict has 'image' and an optional 'detail', got keys {sorted(item)}")
    return item["image"], item.get("detail") or "auto"


def _is_one_frame_list(items: Any) -> bool:
    """A list whose elements are frames is one video, not a list of videos."""
    first = items[0] if items else None
    return isinstance(first, Image.Image) or (isinstance(first, np.ndarray) and first.ndim == 3)
