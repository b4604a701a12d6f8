"""A request's state inside the engine core, and what one step reports for it.

Torch-free: token ids, media features (hash + placeholder range) and counters.
The scheduler moves `num_computed_tokens` towards `num_tokens`; the model runner
samples a token whenever the two meet.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from foveal.engine.plan import Logprobs
from foveal.multimodal.inputs import MMFeature
from foveal.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """vLLM's spelling: "stop" | "length" | "abort" | "error"; None while alive."""
        return FINISH_REASONS.get(self)


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class KVImport:
    """Prompt KV computed elsewhere. blocks: host tensors as
    ModelRunnerOutput.kv_exports holds them, opaque to the scheduler;
    num_tokens: prompt tokens they cover (the last block may be partial)."""

    num_tokens: int
    blocks: dict


class Request:
    """One generation request as the scheduler tracks it.

    num_computed_tokens: tokens whose KV is in the cache (prefix hits included).
    num_cached_tokens:   prefix-cache hit at first admission; -1 before it.
    encoder_cache_queries / encoder_cache_hits: media items this request looked up
                         in the encoder cache (those its prefix-cache hit did not
                         cover), and how many of them were already encoded.
    block_hashes:        prefix hashes of the full blocks of all_token_ids
                         computed so far (filled by the KV manager).
    spec_token_ids:      draft tokens a proposer guessed after all_token_ids,
                         scheduled for verification like any other tokens.
    export_kv:           disaggregated prefill: copy the prompt's KV out when
                         the prompt is computed, for a decode worker.
    kv_import:           disaggregated decode: the prompt KV a prefill worker
                         computed, written into this request's first blocks at
                         admission (then dropped: a preempted request recomputes).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        mm_features: list[MMFeature],
        sampling_params: SamplingParams,
        arrival_time: float,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.mm_features = sorted(mm_features, key=lambda f: f.placeholder.offset)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.cache_salt = cache_salt
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.encoder_cache_queries = 0
        self.encoder_cache_hits = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.error_message: str | None = None
        self.block_hashes: list[bytes] = []
        self.spec_token_ids: list[int] = []
        self.export_kv = False
        self.kv_import: KVImport | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_visual_tokens(self) -> int:
        return sum(f.placeholder.length for f in self.mm_features)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")


@dataclass
class EngineCoreOutput:
    """What one step produced for one request (new tokens, or its end).

    finish_reason is None while the request runs; error is set for "error".
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[Logprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None
    encoder_cache_queries: int = 0  # media items looked up in the encoder cache, so far
    encoder_cache_hits: int = 0  # of those, already encoded
    # disaggregation: the prompt's KV blocks (export_kv), or, from an encode
    # worker, mm_hash -> embeddings (host tensors, opaque here)
    kv_export: dict | None = None
    embeddings: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
