"""POST /v1/chat/completions: messages with text and image_url parts -> one answer,
whole or streamed as chat.completion.chunk events."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, Response

from foveal.engine.output import Logprob, RequestOutput
from foveal.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk,
                                                ChatCompletionRequest, ChatCompletionResponse,
                                                ChatLogprobs, ChatMessage, ChatStreamChoice,
                                                DeltaMessage, TokenLogprob, TopLogprob,
                                                random_id)
from foveal.entrypoints.openai.serving_engine import (SSE_DONE, EngineStreamResponse,
                                                      FinalOutput, OpenAIServing, chain,
                                                      engine_failure, sse, sse_error,
                                                      with_error_event)
from foveal.errors import MediaError, MediaLimitError
from foveal.multimodal.chat import parse_chat_messages

_VIDEO_PART_TYPES = ("video_url", "video")


class OpenAIServingChat(OpenAIServing):
    async def create(self, request: ChatCompletionRequest) -> Response:
        model = self.served_model(request.model)
        params = request.sampling_params()
        prompt = await self._prompt(request)
        request_id = random_id("chatcmpl")
        first, rest = await self.start(prompt, params, request_id)
        top_n = (request.top_logprobs or 0) if request.logprobs else None
        if request.stream:
            events = self._events(model, request_id, first, rest, top_n, request.include_usage)
            return EngineStreamResponse(with_error_event(events), media_type="text/event-stream")
        final = await self.collect(first, rest)
        if final.finish_reason == "error":
            raise engine_failure(final)
        logprobs = None if top_n is None else chat_logprobs(final.token_ids, final.logprobs, top_n)
        choice = ChatChoice(message=ChatMessage(content=final.text), logprobs=logprobs,
                            finish_reason=final.finish_reason, stop_reason=final.stop_reason)
        usage = self.usage(final.prompt_token_ids, final.num_cached_tokens, len(final.token_ids))
        body = ChatCompletionResponse(id=request_id, model=model, choices=[choice], usage=usage)
        return JSONResponse(body.model_dump())

    async def _prompt(self, request: ChatCompletionRequest) -> dict[str, Any]:
        _refuse_video(request.messages)
        template_messages, image_urls = parse_chat_messages(request.messages)
        limit = self.engine.engine_config.multimodal.limit_mm_per_prompt.get("image", 0)
        if len(image_urls) > limit:
            raise MediaLimitError(f"the messages hold {len(image_urls)} images; the limit is "
                                  f"{limit} per request (--limit-mm-per-prompt image=N)")
        images = await asyncio.gather(*(self.fetcher.fetch(url) for url in image_urls))
        text = self.engine.tokenizer.apply_chat_template(
            template_messages, add_generation_prompt=True, **(request.chat_template_kwargs or {}))
        prompt: dict[str, Any] = {"prompt": text}
        if images:
            prompt["multi_modal_data"] = {"image": list(images)}
        if request.mm_processor_kwargs:
            prompt["mm_processor_kwargs"] = request.mm_processor_kwargs
        return prompt

    async def _events(self, model: str, request_id: str, first: RequestOutput,
                      rest: AsyncIterator[RequestOutput], top_n: int | None,
                      include_usage: bool) -> AsyncIterator[str]:
        def chunk(delta: DeltaMessage, **fields) -> str:
            choice = ChatStreamChoice(delta=delta, **fields)
            return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice]))

        final = FinalOutput(list(first.prompt_token_ids))
        yield chunk(DeltaMessage(role="assistant", content=""))
        async for output in chain(first, rest):
            final.add(output)
            completion = output.outputs[0]
            if completion.finish_reason == "error":
                yield sse_error(engine_failure(final))
                break
            logprobs = None if top_n is None else \
                chat_logprobs(completion.token_ids, completion.logprobs, top_n)
            if completion.text or completion.finish_reason or logprobs:
                yield chunk(DeltaMessage(content=completion.text), logprobs=logprobs,
                            finish_reason=completion.finish_reason)
        if include_usage:
            usage = self.usage(final.prompt_token_ids, final.num_cached_tokens,
                               len(final.token_ids))
            yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage))
        yield SSE_DONE


def _refuse_video(messages: list[dict[str, Any]]) -> None:
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in _VIDEO_PART_TYPES:
                raise MediaError("video input is not supported yet; send frames as "
                                 "image_url parts")


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
                  top_n: int) -> ChatLogprobs | None:
    if not logprobs:
        return None
    content = []
    for token_id, position in zip(token_ids, logprobs):
        sampled = position[token_id]
        top = sorted((entry for entry in position.values()
                      if entry.rank is not None and 1 <= entry.rank <= top_n),
                     key=lambda entry: entry.rank)
        content.append(TokenLogprob(**_token_fields(sampled),
                                    top_logprobs=[TopLogprob(**_token_fields(entry))
                                                  for entry in top]))
    return ChatLogprobs(content=content)


def _token_fields(entry: Logprob) -> dict[str, Any]:
    token = entry.decoded_token or ""
    return {"token": token, "logprob": max(entry.logprob, -9999.0),
            "bytes": list(token.encode("utf-8"))}
