"""When a request stops: EOS, stop token ids, max_tokens, max_model_len.

Stop strings are found by the detokenizer in the frontend
(foveal/engine/output.py); everything decidable from token ids is decided here,
over a run of tokens that one step accepted (several with speculation): the
run is cut at the first token that stops the request.
"""
from __future__ import annotations

from foveal.engine.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Finish status after the last appended token, or None to keep going."""
    params = request.sampling_params
    token_id = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in params.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_tokens(request: Request, token_ids: list[int], max_model_len: int
                  ) -> tuple[list[int], RequestStatus | None]:
    """Append an accepted run token by token, stopping at the first stop.

    Returns the tokens kept (a prefix of token_ids) and the finish status, or
    None if the request goes on.
    """
    for count, token_id in enumerate(token_ids, start=1):
        request.append_output_token(token_id)
        status = check_stop(request, max_model_len)
        if status is not None:
            return token_ids[:count], status
    return list(token_ids), None
