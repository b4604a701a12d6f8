"""POST /v1/chat/completions: messages with text, image_url, video_url, file (PDF)
and input_audio parts -> one answer, whole or streamed as chat.completion.chunk
events.

PDF and audio parts go through the preprocessing stages first (as in
`LLM.chat`); then media URLs are fetched here, in the API process, and the
bytes go to the engine with each image's `detail` and the request's
mm_processor_kwargs (max_visual_tokens, max_pixels, fps, transcribe_audio, ...).
The engine sends each video's audio track to the same speech-to-text stage
(when the server built it with these pools) and puts the transcript after the
video; with transcribe_audio=false it does not (and an input_audio part is an
error).
"""
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
from foveal.errors import MediaLimitError
from foveal.multimodal.chat import ChatConversation, parse_chat_conversation
from foveal.stages.assembly import (PreprocessOptions, expand_preprocessed_parts, needs_stages,
                                    split_preprocess_options)


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine, config, metrics, fetcher, stages) -> None:
        """stages: the server's StagePools (PDF, OCR and ASR worker pools)."""
        super().__init__(engine, config, metrics, fetcher)
        self.stages = stages

    async def create(self, request: ChatCompletionRequest) -> Response:
        model = self.served_model(request.model)
        params = request.sampling_params()
        prompt = await self._prompt(request)
        request_id = random_id("chatcmpl")
        first, rest = await self.start(prompt, params, request_id, request)
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
        body = ChatCompletionResponse(id=request_id, model=model, choices=[choice],
                                      usage=self.usage(final))
        return JSONResponse(final.response(body))

    async def _prompt(self, request: ChatCompletionRequest) -> dict[str, Any]:
        options, processor_kwargs = split_preprocess_options(request.mm_processor_kwargs)
        options = PreprocessOptions.from_request(options)
        messages = request.messages
        if needs_stages(messages, {"ocr": options.ocr}):
            messages = await expand_preprocessed_parts(messages, self.stages, options)
        conversation = parse_chat_conversation(messages)
        self._check_counts(conversation)
        text = self.engine.tokenizer.apply_chat_template(
            conversation.messages, add_generation_prompt=True,
            **(request.chat_template_kwargs or {}))
        prompt: dict[str, Any] = {"prompt": text}
        if conversation.images or conversation.videos:
            prompt["multi_modal_data"] = await self._fetch_media(conversation)
        if processor_kwargs:
            prompt["mm_processor_kwargs"] = processor_kwargs
        return prompt

    def _check_counts(self, conversation: ChatConversation) -> None:
        """Before fetching: a request over the limit must not cost any downloads."""
        limits = self.engine.engine_config.multimodal.limit_mm_per_prompt
        for modality, items in (("image", conversation.images), ("video", conversation.videos)):
            limit = limits.get(modality, 0)
            if len(items) > limit:
                raise MediaLimitError(f"the messages hold {len(items)} {modality}s; the limit is "
                                      f"{limit} per request (--limit-mm-per-prompt {modality}=N)")

    async def _fetch_media(self, conversation: ChatConversation) -> dict[str, list]:
        """Every URL fetched concurrently; an image keeps its {"detail": ...} wrapper."""
        image_urls = [item["image"] if isinstance(item, dict) else item
                      for item in conversation.images]
        fetched = await asyncio.gather(
            *(self.fetcher.fetch(url, "image") for url in image_urls),
            *(self.fetcher.fetch(url, "video") for url in conversation.videos))
        images = [{**item, "image": data} if isinstance(item, dict) else data
                  for item, data in zip(conversation.images, fetched)]
        media = {"image": images, "video": list(fetched[len(images):])}
        return {modality: items for modality, items in media.items() if items}

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
            yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[],
                                          usage=self.usage(final)))
        yield SSE_DONE


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
