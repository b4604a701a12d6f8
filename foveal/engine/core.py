"""The engine core loop: schedule, execute, update."""
from __future__ import annotations

import time
from typing import Iterable, Protocol

from foveal.engine.plan import ModelRunnerOutput, StepPlan, kv_payload_key
from foveal.engine.request import EngineCoreOutput, Request, RequestStatus
from foveal.engine.scheduler import Scheduler


class Executor(Protocol):
    def execute(self, plan: StepPlan, mm_payloads: dict[str, dict]) -> ModelRunnerOutput:
        """Run one step. A plan may schedule no tokens and only carry
        finished_request_ids / freed_mm_hashes for the workers to drop.
        mm_payloads: mm_hash -> array data (pixels) of the items it encodes."""


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor):
        self.scheduler = scheduler
        self.executor = executor

    @property
    def num_blocks(self) -> int:
        return self.scheduler.kv.num_blocks

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.abort_requests(request_ids, status)

    def step(self) -> list[EngineCoreOutput]:
        """One step. An executor error for the whole batch is an engine bug: it propagates."""
        plan = self.scheduler.schedule()
        if plan.is_empty and not plan.finished_request_ids and not plan.freed_mm_hashes:
            return []
        started = time.perf_counter()
        runner_output = self.executor.execute(plan, self._payloads(plan))
        self.scheduler.step_cost.observe(plan.total_num_scheduled_tokens, plan.num_encoder_tokens,
                                         time.perf_counter() - started, plan.sized_to_target)
        return self.scheduler.update_from_output(plan, runner_output)

    def _payloads(self, plan: StepPlan) -> dict[str, dict]:
        """Arrays travel beside the plan, once: pixels (or imported embeddings)
        of the items the workers encode this step, by mm_hash; imported KV
        blocks of the requests admitted with them, which the engine then drops
        (a request preempted later recomputes its prompt)."""
        payloads: dict[str, dict] = {}
        for request_id, indices in plan.scheduled_encoder_inputs.items():
            features = self.scheduler.requests[request_id].mm_features
            for index in indices:
                payloads.setdefault(features[index].mm_hash, features[index].payload)
        for request_id in plan.kv_imports:
            request = self.scheduler.requests[request_id]
            payloads[kv_payload_key(request_id)] = request.kv_import.blocks
            request.kv_import = None
        return payloads

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> dict:
        return self.scheduler.get_stats()
