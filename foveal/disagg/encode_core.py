"""The engine core of an encode worker: media items in, embeddings out.

An encode worker runs the vision tower only. Its core has no KV pool and no
scheduler of token windows: each step takes waiting requests in arrival
order while their items fit the encoder compute budget (at least one
request), runs the new items (distinct mm_hash) through the workers' tower in
one call, and finishes each request with its embeddings by mm_hash. The API
process keeps them in its export store (the encode worker's embedding cache)
and serves them to prefill workers. Torch-free, like the engine package: the
embeddings are opaque values here.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable

from foveal.engine.request import EngineCoreOutput, Request, RequestStatus
from foveal.engine.stats import SchedulerStats
from foveal.errors import InvalidRequestError


class EncodeCore:
    """Same surface as EngineCore, for the core process loop."""

    num_blocks = 0  # no KV pool

    def __init__(self, executor, encoder_compute_budget: int) -> None:
        self.executor = executor
        self.budget = encoder_compute_budget
        self.waiting: deque[Request] = deque()
        self.stats = SchedulerStats()

    def add_request(self, request: Request) -> None:
        if any(r.request_id == request.request_id for r in self.waiting):
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use; "
                                      "send a unique request id")
        for feature in request.mm_features:
            if feature.num_encoder_tokens > self.budget:
                raise InvalidRequestError(
                    f"a {feature.modality} item has {feature.num_encoder_tokens} visual tokens; "
                    f"one step may encode {self.budget} (--encoder-compute-budget)")
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        ids = set(request_ids)
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[EngineCoreOutput]:
        batch = self._take_batch()
        if not batch:
            return []
        items = {f.mm_hash: f for request in batch for f in request.mm_features}
        result = self.executor.collective_rpc(
            "encode", [f.without_payload() for f in items.values()],
            {h: f.payload for h, f in items.items()})[0]
        self.stats.encoder_items += len(result["embeddings"])
        return [self._finish(request, result) for request in batch]

    def _take_batch(self) -> list[Request]:
        batch, tokens = [], 0
        while self.waiting:
            size = sum(f.num_encoder_tokens for f in self.waiting[0].mm_features)
            if batch and tokens + size > self.budget:
                break
            batch.append(self.waiting.popleft())
            tokens += size
        return batch

    def _finish(self, request: Request, result: dict) -> EngineCoreOutput:
        errors = [result["failed"][f.mm_hash] for f in request.mm_features
                  if f.mm_hash in result["failed"]]
        if errors:
            self.stats.finished["error"] += 1
            return EngineCoreOutput(request.request_id, [], "error", error=errors[0])
        self.stats.finished["stop"] += 1
        self.stats.visual_tokens += request.num_visual_tokens
        embeddings = {f.mm_hash: result["embeddings"][f.mm_hash] for f in request.mm_features}
        return EngineCoreOutput(request.request_id, [], "stop", embeddings=embeddings)

    def get_stats(self) -> dict:
        return self.stats.as_dict(0, len(self.waiting), 0.0)
