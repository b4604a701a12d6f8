"""What chat and text completions share: the served-model check, the engine
stream (aborted when its consumer goes away), a request cancelled when its
client disconnects, folding deltas into one answer, usage, and Server-Sent
Events framing."""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive

from foveal.engine.output import Logprob, RequestOutput
from foveal.entrypoints.openai.errors import APIError, error_body, status_of
from foveal.entrypoints.openai.metrics import ServerMetrics, TokenTimer
from foveal.entrypoints.openai.protocol import MediaItemPlan, PromptTokensDetails, UsageInfo
from foveal.entrypoints.openai.security import SecurityConfig
from foveal.errors import FovealError, InvalidRequestError
from foveal.multimodal.media.fetch import MediaFetchConfig, MediaFetcher
from foveal.sampling_params import SamplingParams
from foveal.stages.config import StagesConfig


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    model_path: str
    security: SecurityConfig = field(default_factory=SecurityConfig)  # keys, limits, body size
    media: MediaFetchConfig = field(default_factory=MediaFetchConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)  # PDF, OCR, ASR pools
    playground: bool = True  # the web page at "/" (foveal/entrypoints/openai/playground)


@dataclass
class FinalOutput:
    """Every delta of one request folded together."""

    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
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
        self.encoder_cache_queries = output.encoder_cache_queries
        self.encoder_cache_hits = output.encoder_cache_hits
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

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client abandoned


async def unless_disconnected(work: Awaitable[Response], receive: Receive) -> Response:
    """`work`'s response, unless the client disconnects first: then `work` is
    cancelled, which aborts all it started (stage jobs, preprocessing, the engine
    request), and a 499 goes to nobody. Once the body has been read, the next
    ASGI message is http.disconnect, so one pending receive() watches for free.
    A streamed response, once returned, watches its client itself."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # its cleanup (aborts) runs before we return
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


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

    async def create(self, request: BaseModel) -> Response:
        raise NotImplementedError

    async def handle(self, request: BaseModel, raw_request: Request) -> Response:
        """create(request), cancelled if the client disconnects first."""
        return await unless_disconnected(self.create(request), raw_request.receive)

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
        # closed on cancellation too (client gone), so the request is aborted now
        async with contextlib.aclosing(chain(first, rest)) as outputs:
            async for output in outputs:
                final.add(output)
        return final

    def usage(self, final: FinalOutput) -> UsageInfo:
        prompt_ids = final.prompt_token_ids
        num_prompt, num_completion = len(prompt_ids), len(final.token_ids)
        plan = [MediaItemPlan.model_validate(item, from_attributes=True)
                for item in final.mm_plan or ()]
        # per modality from the plan: a family may fill a video with image tokens (SmolVLM)
        visual = {modality: sum(item.num_tokens for item in plan if item.modality == modality)
                  for modality in ("image", "video")} if plan else {
            "image": prompt_ids.count(self.image_token_id),
            "video": prompt_ids.count(self.video_token_id)}
        details = PromptTokensDetails(cached_tokens=final.num_cached_tokens,
                                      image_tokens=visual["image"], video_tokens=visual["video"],
                                      encoder_cache_queries=final.encoder_cache_queries,
                                      encoder_cache_hits=final.encoder_cache_hits)
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
