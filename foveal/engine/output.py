"""Frontend side of the engine: incremental detokenization, stop strings and
vLLM-shaped RequestOutput objects."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from foveal.engine.plan import Logprobs
from foveal.engine.request import EngineCoreOutput
from foveal.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    preprocess_time: float | None = None  # seconds in tokenization + media processing


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    # The downsampling planner's choice per media item, in prompt order
    # (foveal.multimodal.budget.ItemPlan: modality, max_pixels, num_frames, num_tokens, detail).
    mm_plan: list | None = None
    # Media items looked up in the encoder cache so far (those the prefix-cache hit
    # did not cover), and how many were already encoded there.
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    # Disaggregated serving, on the final output: where a decode worker pulls
    # this prompt's KV (prefill), or a prefill worker the embeddings (encode).
    kv_transfer_params: dict | None = None
    ec_transfer_params: dict | None = None


class IncrementalDetokenizer:
    """Turns a growing token list into text, emitting only complete characters.

    Decodes the window tokens[prefix_offset:] and compares it with the decode
    of tokens[prefix_offset:read_offset]: the difference is new text, held back
    while it ends in U+FFFD (a multi-byte character split across tokens).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they completed (may be empty)."""
        self.token_ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self._prefix_offset:self._read_offset],
                             skip_special_tokens=self.skip_special_tokens)
        window_text = decode(self.token_ids[self._prefix_offset:],
                             skip_special_tokens=self.skip_special_tokens)
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        new_text = window_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += new_text
        return new_text


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """First stop string that ends in the last num_new_chars chars: (stop, index)."""
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    stream_delta: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    text: str = ""  # after stop-string truncation
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_chars: int = 0
    num_sent_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    """Turns EngineCoreOutputs into RequestOutputs, one per request per step.

    Streaming mode per request: cumulative text and tokens (default) or deltas.
    A stop string finishes the request here; its id is returned so the caller
    aborts it in the engine core.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, arrival_time: float | None = None,
                    stream_delta: bool = False) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, sampling_params.skip_special_tokens)
        metrics = RequestMetrics(arrival_time if arrival_time is not None else time.time())
        state = _RequestState(request_id, prompt, list(prompt_token_ids), sampling_params,
                              detokenizer, metrics, stream_delta)
        if sampling_params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        self._states[request_id] = state

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def num_unfinished_requests(self) -> int:
        return len(self._states)

    def process(self, outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput], list[str]]:
        request_outputs: list[RequestOutput] = []
        request_ids_to_abort: list[str] = []
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None:
                continue  # aborted by the frontend meanwhile
            if self._apply(state, output) and output.finish_reason is None:
                request_ids_to_abort.append(output.request_id)
            request_output = self._make_output(state, output)
            if request_output is not None:
                request_outputs.append(request_output)
            if state.finished:
                del self._states[output.request_id]
        return request_outputs, request_ids_to_abort

    def _apply(self, state: _RequestState, output: EngineCoreOutput) -> bool:
        """Fold one step into the state; True if a stop string finished it."""
        now = time.time()
        if output.new_token_ids:
            state.metrics.first_token_time = state.metrics.first_token_time or now
            state.metrics.last_token_time = now
        state.token_ids.extend(output.new_token_ids)
        self._append_logprobs(state, output.new_logprobs)
        hit_stop_string = self._detokenize(state, output)
        if not hit_stop_string and output.finish_reason is not None:
            state.finish_reason, state.stop_reason = output.finish_reason, output.stop_reason
        if state.finished:
            state.metrics.finished_time = now
        return hit_stop_string

    def _detokenize(self, state: _RequestState, output: EngineCoreOutput) -> bool:
        """Fold new tokens into the text; True if a stop string ended it.

        With stop strings, a run of several tokens (speculative decoding) is
        read token by token: the tokens after the one that completes a stop
        string are dropped, as if they had never been generated.
        """
        params = state.params
        token_ids = output.new_token_ids
        stopped_on_token = output.finish_reason == "stop" and isinstance(output.stop_reason, int)
        if stopped_on_token and not params.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        runs = [token_ids] if not params.stop else [[t] for t in token_ids]
        for count, run in enumerate(runs, start=1):
            if self._detokenize_run(state, run):
                self._drop_tokens_after(state, output, sum(len(r) for r in runs[:count]))
                return True
        return False

    def _detokenize_run(self, state: _RequestState, token_ids: list[int]) -> bool:
        params = state.params
        new_text = state.detokenizer.update(token_ids) if token_ids else ""
        state.text += new_text
        found = find_stop_string(state.text, len(new_text), params.stop) if new_text else None
        if found is None:
            return False
        stop, index = found
        state.text = state.text[:index + len(stop) if params.include_stop_str_in_output else index]
        state.finish_reason, state.stop_reason = "stop", stop
        return True

    @staticmethod
    def _drop_tokens_after(state: _RequestState, output: EngineCoreOutput, num_kept: int) -> None:
        """Forget this step's tokens after the first num_kept (and their logprobs)."""
        num_dropped = len(output.new_token_ids) - num_kept
        if num_dropped <= 0:
            return
        del state.token_ids[-num_dropped:]
        if state.logprobs is not None:
            for position in output.new_logprobs[num_kept:]:
                state.cumulative_logprob -= position.logprobs[0]
            del state.logprobs[-num_dropped:]

    def _append_logprobs(self, state: _RequestState, new_logprobs: list[Logprobs]) -> None:
        if state.logprobs is None:
            return
        for position in new_logprobs:
            entry = {position.token_ids[0]: self._logprob(
                position.token_ids[0], position.logprobs[0], position.sampled_rank)}
            top = zip(position.token_ids[1:], position.logprobs[1:])
            for rank, (token_id, value) in enumerate(top, start=1):
                if token_id not in entry:
                    entry[token_id] = self._logprob(token_id, value, rank)
            state.logprobs.append(entry)
            state.cumulative_logprob += position.logprobs[0]

    def _logprob(self, token_id: int, value: float, rank: int) -> Logprob:
        return Logprob(value, rank, self.tokenizer.decode([token_id], skip_special_tokens=False))

    def _visible_text(self, state: _RequestState) -> str:
        """Text safe to show: while streaming, a possible partial stop string is held back."""
        params = state.params
        if state.finished or not params.stop or params.include_stop_str_in_output:
            return state.text
        hold_back = max(len(stop) for stop in params.stop) - 1
        return state.text[:max(len(state.text) - hold_back, state.num_sent_chars)]

    def _make_output(self, state: _RequestState, output: EngineCoreOutput
                     ) -> RequestOutput | None:
        visible = self._visible_text(state)
        text, token_ids, logprobs = visible, state.token_ids, state.logprobs
        if state.stream_delta:
            if len(visible) == state.num_sent_chars and not output.new_token_ids \
                    and not state.finished:
                return None
            text = visible[state.num_sent_chars:]
            token_ids = token_ids[state.num_sent_tokens:]
            logprobs = None if logprobs is None else logprobs[state.num_sent_tokens:]
        state.num_sent_chars = len(visible)
        state.num_sent_tokens = len(state.token_ids)
        completion = CompletionOutput(0, text, list(token_ids), state.cumulative_logprob,
                                      None if logprobs is None else list(logprobs),
                                      state.finish_reason, state.stop_reason)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             [completion], state.finished, output.num_cached_tokens,
                             state.metrics, output.error,
                             encoder_cache_queries=output.encoder_cache_queries,
                             encoder_cache_hits=output.encoder_cache_hits)
