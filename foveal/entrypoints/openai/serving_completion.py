"""POST /v1/completions: a text (or token-id) prompt -> one continuation, whole or
streamed as text_completion events."""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, Response

from foveal.engine.output import Logprob, RequestOutput
from foveal.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                                CompletionRequest, CompletionResponse,
                                                random_id)
from foveal.entrypoints.openai.serving_engine import (SSE_DONE, EngineStreamResponse,
                                                      FinalOutput, OpenAIServing, chain,
                                                      check_token_ids, engine_failure, sse,
                                                      sse_error, with_error_event)
from foveal.errors import InvalidRequestError


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest) -> Response:
        model = self.served_model(request.model)
        params = request.sampling_params()
        prompt = _engine_prompt(request, self.engine.engine_config.model.text.vocab_size)
        request_id = random_id("cmpl")
        first, rest = await self.start(prompt, params, request_id, request)
        if request.stream:
            events = self._events(model, request_id, first, rest, request.logprobs,
                                  request.include_usage)
            return EngineStreamResponse(with_error_event(events), media_type="text/event-stream")
        final = await self.collect(first, rest)
        if final.finish_reason == "error":
            raise engine_failure(final)
        choice = CompletionChoice(
            text=final.text, finish_reason=final.finish_reason, stop_reason=final.stop_reason,
            logprobs=completion_logprobs(final.token_ids, final.logprobs, request.logprobs, 0))
        usage = self.usage(final)
        body = CompletionResponse(id=request_id, model=model, choices=[choice], usage=usage)
        return JSONResponse(final.response(body))

    async def _events(self, model: str, request_id: str, first: RequestOutput,
                      rest: AsyncIterator[RequestOutput], top_n: int | None,
                      include_usage: bool) -> AsyncIterator[str]:
        final = FinalOutput(list(first.prompt_token_ids))
        async for output in chain(first, rest):
            text_offset = len(final.text)
            final.add(output)
            completion = output.outputs[0]
            if completion.finish_reason == "error":
                yield sse_error(engine_failure(final))
                break
            if not (completion.text or completion.finish_reason or completion.token_ids):
                continue
            logprobs = completion_logprobs(completion.token_ids, completion.logprobs, top_n,
                                           text_offset)
            choice = CompletionChoice(text=completion.text, logprobs=logprobs,
                                      finish_reason=completion.finish_reason,
                                      stop_reason=completion.stop_reason)
            yield sse(CompletionResponse(id=request_id, model=model, choices=[choice]))
        if include_usage:
            yield sse(CompletionResponse(id=request_id, model=model, choices=[],
                                         usage=self.usage(final)))
        yield SSE_DONE


def _engine_prompt(request: CompletionRequest, vocab_size: int) -> dict[str, Any]:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(item, str) for item in prompt):
        if len(prompt) != 1:
            raise InvalidRequestError(f"got {len(prompt)} prompts; this server takes one "
                                      "prompt per request (send one request each)")
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt:
            raise InvalidRequestError("prompt is empty; send text or token ids")
        check_token_ids(prompt, vocab_size, "prompt")
        engine_prompt: dict[str, Any] = {"prompt_token_ids": list(prompt)}
    else:
        engine_prompt = {"prompt": prompt}
    if request.mm_processor_kwargs:
        engine_prompt["mm_processor_kwargs"] = request.mm_processor_kwargs
    return engine_prompt


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
                        top_n: int | None, text_offset: int) -> CompletionLogprobs | None:
    if top_n is None or logprobs is None:
        return None
    result = CompletionLogprobs()
    for token_id, position in zip(token_ids, logprobs):
        sampled = position[token_id]
        token = sampled.decoded_token or ""
        top = sorted((entry for entry in position.values()
                      if entry.rank is not None and 1 <= entry.rank <= top_n),
                     key=lambda entry: entry.rank)
        result.tokens.append(token)
        result.token_logprobs.append(max(sampled.logprob, -9999.0))
        result.top_logprobs.append({entry.decoded_token or "": max(entry.logprob, -9999.0)
                                    for entry in top})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result
