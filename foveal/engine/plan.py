"""The plan a scheduler step hands to the workers, and what they hand back.

Contract 1 of the design: plain data with ints and lists only, no tensors.
The same plan drives one in-process worker, N tensor-parallel ranks or a
remote worker.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from foveal.multimodal.inputs import MMFeature
from foveal.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen yet (or see again after preemption).

    token_ids holds every known token: prompt plus outputs generated so far.
    mm_features carry no pixels (MMFeature.without_payload): their plain data
    (grid, timing) is what position rules need; pixels reach the workers once,
    by mm_hash, beside the plan of the step that encodes them.
    """

    request_id: str
    token_ids: list[int]
    mm_features: list[MMFeature]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV cache group (foveal/engine/kv_groups.py)
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the workers already hold: only what changed this step.

    Workers drop the last num_trimmed_blocks of each group's block table (given
    back after rejected drafts), then append that group's new_block_ids. Blocks
    a sliding group gave back before its window are not announced: no query
    reads them again.
    """

    request_id: str
    new_block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int
    num_trimmed_blocks: int = 0


@dataclass
class KVTransferPlan:
    """Block copies between the KV pool and a second tier (offload, or a remote
    peer for disaggregation), keyed by block hash (sha256 hex).

    Workers apply them before the step's forward, in this order: saves (pool
    block -> tier), loads (tier -> pool block), drops (tier entries deleted).
    A save reads a block before a load or the forward overwrites it.
    """

    saves: list[tuple[str, int]] = field(default_factory=list)  # (block hash, block id)
    loads: list[tuple[str, int]] = field(default_factory=list)  # (block hash, block id)
    drops: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.drops)


@dataclass
class EncoderTransferPlan:
    """Encoder outputs moving between the workers' encoder cache and an encoder
    connector (a shared embedding store, or an encode worker for
    disaggregation), keyed by mm_hash. Loads run before the step's encoder,
    saves after it."""

    loads: list[str] = field(default_factory=list)
    saves: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass
class StepPlan:
    """One engine step.

    num_scheduled_tokens: request id -> tokens to compute this step, starting
        at that request's num_computed_tokens. A request whose computed count
        reaches its known token count this step gets a token sampled.
    scheduled_encoder_inputs: request id -> indices into its mm_features to run
        through the vision encoder this step (before the LLM forward).
    scheduled_spec_decode_tokens: request id -> draft tokens to verify this
        step. They are the last len(draft) of that request's scheduled
        tokens; the workers sample every verified position and return the
        accepted run plus one token.
    freed_mm_hashes: encoder-cache entries the workers may drop.
    finished_request_ids: requests that ended since the last step (finished or
        aborted); workers drop their state.
    kv_transfer: block copies to and from the KV offload tier, or None.
    encoder_transfer: encoder outputs to load from / save to an encoder
        connector, or None.
    kv_imports: request id -> (index into the request's imported blocks,
        pool block id) pairs: KV a prefill worker computed, written before the
        forward; the blocks travel beside the plan (`kv_payload_key`).
    kv_exports: request id -> prompt tokens whose KV the workers copy out
        after this step's forward, for a decode worker to continue from.
    num_encoder_tokens: visual tokens the vision tower computes this step (the
        engine's step cost model reads it beside the step's time).
    sized_to_target: prompt work sized to fit beside decode rows in
        `target_itl_ms` (the step cost model compares its time with the fit's).
    """

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    freed_mm_hashes: list[str] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    kv_transfer: KVTransferPlan | None = None
    encoder_transfer: EncoderTransferPlan | None = None
    kv_imports: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    kv_exports: dict[str, int] = field(default_factory=dict)
    num_encoder_tokens: int = 0
    sized_to_target: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class Logprobs:
    """Top-k log-probabilities of one sampled position.

    token_ids[0] / logprobs[0] are the sampled token; the rest the top-k.
    ranks[0] is the sampled token's rank (1 = most likely).
    """

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


@dataclass
class ModelRunnerOutput:
    """What a step produced for each request that reached the end of its known
    tokens (requests mid-prefill are absent): the tokens it accepted, in
    order. One token without speculation; with draft tokens, the accepted
    drafts plus the token sampled after them."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)  # one per token
    # request id -> draft tokens a proposer guessed after this step's tokens
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_encoder_items_run: int = 0
    # request id -> error message for requests whose inputs failed in the
    # worker (e.g. an encoder input that could not be run); they fail alone.
    failed_requests: dict[str, str] = field(default_factory=dict)
    # request id -> its prompt's KV blocks (StepPlan.kv_exports), host tensors:
    # "kv" (num_tensors, 2, num_groups * num_blocks, block_size, Hkv, D), each KV cache
    # group's blocks one after another, and, quantized, "scales"
    kv_exports: dict[str, dict] = field(default_factory=dict)


def kv_payload_key(request_id: str) -> str:
    """Key of a request's imported KV blocks among the arrays that travel beside
    a plan (media payloads are keyed by mm_hash, a hex digest: no clash)."""
    return f"kv:{request_id}"
