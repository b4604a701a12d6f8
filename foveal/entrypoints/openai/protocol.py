"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests accept OpenAI's fields plus Foveal's extras (`ignore_eos`, `top_k`,
`min_p`, `mm_processor_kwargs`); fields no endpoint uses are ignored, as
OpenAI clients send many. `mm_processor_kwargs` carries the model processor's
keys (max_pixels, fps, max_visual_tokens, ...) and the preprocessing stages'
options (pdf_mode, ocr, transcribe_audio, ...).

Responses add to OpenAI's `usage`: `prompt_tokens_details.image_tokens` and
`.video_tokens` (visual tokens in the prompt), `.encoder_cache_queries` and
`.encoder_cache_hits` (media items looked up in the encoder cache, and found
there), and `mm_plan`, the downsampling
planner's choice per media item in prompt order (modality, num_tokens, detail,
num_frames, max_pixels, the resized width and height, and whether the budget
downsampled it). Options Foveal cannot honour yet (n > 1, penalties, tools,
response formats) fail with a message instead of being dropped.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from foveal.errors import InvalidRequestError, SamplingParamsError
from foveal.sampling_params import SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by chat and text completions. Strict: a JSON value of the
    wrong type ("0.5" for temperature, true for max_tokens) is a 400, not coerced."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        """`"temperature": null` is the field left out, as OpenAI's API reads it
        (many clients send every field, unset ones as null)."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative_decoding: bool = True  # false: no draft tokens for this request
    mm_processor_kwargs: dict[str, Any] | None = None
    # disaggregated serving (a router sets these; foveal/disagg/exchange.py)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise SamplingParamsError(f"n={self.n} is not supported yet; use n=1 "
                                      "(send several requests for several answers)")
        if self.presence_penalty or self.frequency_penalty:
            raise SamplingParamsError("presence_penalty and frequency_penalty are not "
                                      "supported yet; leave them at 0")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream=true")

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self.check_supported()
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            speculative_decoding=self.speculative_decoding)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def sampling_params(self) -> SamplingParams:
        if self.tools:
            raise InvalidRequestError("tools are not supported yet; remove 'tools'")
        if self.response_format and self.response_format.get("type") != "text":
            raise InvalidRequestError("response_format other than 'text' is not supported yet")
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamsError("top_logprobs needs logprobs=true")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or ()))
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}; the server "
                                      "sets those itself")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_tokens if self.max_completion_tokens is None \
            else self.max_completion_tokens
        return self.to_sampling_params(max_tokens, logprobs)


# What the server passes to the chat template itself; a "chat_template" would
# also run the client's Jinja code on the server.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "documents",
                                       "chat_template"})


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise InvalidRequestError("echo=true is not supported yet; leave it false")
        if self.best_of not in (None, 1):
            raise SamplingParamsError(f"best_of={self.best_of} is not supported; use 1")
        return self.to_sampling_params(self.max_tokens, self.logprobs)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    image_tokens: int = 0
    video_tokens: int = 0
    # media items looked up in the encoder cache (those the prefix-cache hit did not
    # cover), and how many of them were already encoded there
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0


class MediaItemPlan(BaseModel):
    """The planner's setting for one media item (foveal.multimodal.budget.ItemPlan)."""

    modality: Literal["image", "video"]
    num_tokens: int
    detail: str
    num_frames: int  # 1 for images
    max_pixels: int
    width: int = 0  # frame size after resizing, in pixels
    height: int = 0
    downsampled: bool = False  # the visual-token budget cut it below its preferred setting


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    mm_plan: list[MediaItemPlan] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None

    @model_serializer
    def _without_nulls(self) -> dict[str, str]:
        # OpenAI's deltas carry only the fields that changed.
        return {key: value for key, value in (("role", self.role), ("content", self.content))
                if value is not None}


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "foveal"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
