"""What chat and text completions share: the served-model check, the engine
stream (aborted when its consumer goes away), folding deltas into one answer,
usage, and Server-Sent Events framing."""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, AsyncIterator

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse

from foveal.engine.output import Logprob, RequestOutput
from foveal.entrypoints.openai.errors import APIError, error_body, status_of
from foveal.entrypoints.openai.metrics import ServerMetrics, TokenTimer
from foveal.entrypoints.openai.protocol import MediaItemPlan, PromptTokensDetails, UsageInfo
from foveal.errors import FovealError, InvalidRequestError
from foveal.multimodal.media.fetch import MediaFetchConfig, MediaFetcher
from foveal.sampling_params import SamplingParams
from foveal.stages.config import StagesConfig


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    model_path: str
    api_key: str | None = None
    media: MediaFetchConfig = field(default_factory=MediaFetchConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)  # PDF, OCR, ASR pools


@dataclass
class FinalOutput:
    """Every delta of one request folded together."""

    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    mm_plan: list | None = None  # ItemPlan per media item, from the first output
    transfer_params: dict = field(default_factory=dict)  # what this engine exported

    def add(self, output: RequestOutput) -> None:
        completion = output.outputs[0]
        self.text += completion.text
        self.token_ids += completion.token_ids
        if completion.logprobs is not None:
            self.logprobs = (self.logprobs or []) + completion.logprobs
        self.num_cached_tokens = output.num_cached_tokens
        self.finish_reason, self.stop_reason = completion.finish_reason, completion.stop_reason
        self.error = output.error or self.error
        self.mm_plan = output.mm_plan or self.mm_plan
        for name in ("kv_transfer_params", "ec_transfer_params"):
            if getattr(output, name, None) is not None:
                self.transfer_params[name] = getattr(output, name)

    def response(self, body: BaseModel) -> dict:
        """The response body, with the transfer parameters of a disaggregated
        prefill or encode (the router passes them to the next worker)."""
        return {**body.model_dump(), **self.transfer_params}


class EngineStreamResponse(StreamingResponse):
    """Closes its body generator when the response ends for any reason (client
    gone included), so the engine request behind it is aborted right away."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def sse(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) \
        else json.dumps(payload, separators=(",", ":"))
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class OpenAIServing:
    def __init__(self, engine, config: ServerConfig, metrics: ServerMetrics,
                 fetcher: MediaFetcher) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.fetcher = fetcher
        self.image_token_id = engine.engine_config.model.image_token_id
        self.video_token_id = engine.engine_config.model.video_token_id
        self.vocab_size = engine.engine_config.model.text.vocab_size

    def served_model(self, requested: str | None) -> str:
        names = self.config.served_model_names
        if requested is None or requested in names:
            return requested or names[0]
        raise APIError(f"model {requested!r} is not served here; use one of {list(names)}",
                       param="model")

    async def start(self, prompt: Any, params: SamplingParams, request_id: str,
                    request: BaseModel | None = None
                    ) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """Submit and wait for the first output, so validation errors (raised before
        the first yield) become HTTP errors rather than a broken stream.
        request: the body, for its disaggregation fields."""
        check_token_ids(params.stop_token_ids, self.vocab_size, "stop_token_ids")
        transfer = {name: getattr(request, name) for name in
                    ("kv_transfer_params", "ec_transfer_params")
                    if getattr(request, name, None) is not None}
        exports = (getattr(self.engine, "role", "mixed") == "encode"
                   or (transfer.get("kv_transfer_params") or {}).get("do_remote_decode"))
        if exports and getattr(request, "stream", False):
            raise InvalidRequestError("a disaggregated encode or prefill answers with its transfer "
                                      "parameters in one JSON body: send stream=false")
        stream = self._deltas(prompt, params, request_id, transfer)
        try:
            first = await stream.__anext__()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise
        return first, stream

    async def _deltas(self, prompt: Any, params: SamplingParams, request_id: str,
                      transfer: dict) -> AsyncIterator[RequestOutput]:
        outputs = self.engine.generate(prompt, params, request_id, stream=True, **transfer)
        timer = TokenTimer(self.metrics)
        finished = False
        try:
            async for output in outputs:
                timer.on_output(output)
                finished = output.finished
                yield output
        finally:
            if not finished:
                with anyio.CancelScope(shield=True):
                    await outputs.aclose()
                    with contextlib.suppress(Exception):
                        await self.engine.abort(request_id)

    async def collect(self, first: RequestOutput, rest: AsyncIterator[RequestOutput]
                      ) -> FinalOutput:
        final = FinalOutput(list(first.prompt_token_ids))
        async for output in chain(first, rest):
            final.add(output)
        return final

    def usage(self, final: FinalOutput) -> UsageInfo:
        prompt_ids = final.prompt_token_ids
        num_prompt, num_completion = len(prompt_ids), len(final.token_ids)
        details = PromptTokensDetails(cached_tokens=final.num_cached_tokens,
                                      image_tokens=prompt_ids.count(self.image_token_id),
                                      video_tokens=prompt_ids.count(self.video_token_id))
        plan = [MediaItemPlan(modality=item.modality, num_tokens=item.num_tokens,
                              detail=item.detail, num_frames=item.num_frames,
                              max_pixels=item.max_pixels) for item in final.mm_plan or ()]
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                         total_tokens=num_prompt + num_completion,
                         prompt_tokens_details=details, mm_plan=plan)


def check_token_ids(token_ids: list[int], vocab_size: int, field_name: str) -> None:
    """Ids outside the embedding table would crash the engine for everyone."""
    bad = [token_id for token_id in token_ids if not 0 <= token_id < vocab_size]
    if bad:
        raise InvalidRequestError(f"{field_name} holds token ids {bad[:5]} outside the "
                                  f"model's vocabulary [0, {vocab_size})")


async def chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]
                ) -> AsyncIterator[RequestOutput]:
    """`first` then `rest`; closing this closes `rest` (and so aborts the request)."""
    try:
        yield first
        async for output in rest:
            yield output
    finally:
        with anyio.CancelScope(shield=True):
            await rest.aclose()


async def with_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """SSE events; an engine error after the stream started (headers are sent, so
    no status can change) becomes a final error event, as OpenAI's API does."""
    try:
        async for event in events:
            yield event
    except FovealError as error:
        yield sse(error_body(str(error), status_of(error)))
        yield SSE_DONE
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()


def engine_failure(final: FinalOutput) -> APIError:
    """A request the engine failed on its own (not the client's fault)."""
    return APIError(f"the engine failed this request: {final.error or 'unknown error'}",
                    HTTPStatus.INTERNAL_SERVER_ERROR)


def sse_error(error: APIError) -> str:
    return sse(error_body(str(error), error.status))
