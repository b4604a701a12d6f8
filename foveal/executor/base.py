"""What every executor does: drive one worker per rank through the same calls.

Subclasses say only how a call reaches the workers (`collective_rpc`): in
process, over pipes to local processes, or to Ray actors. The StepPlan and
the media payloads go to every rank; rank 0's ModelRunnerOutput is the step's
result (sampling is identical on every rank, so ranks never diverge).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from foveal.config import EngineConfig
from foveal.engine.plan import ModelRunnerOutput, StepPlan
from foveal.layers.attention.kv_spec import KVCacheSpec


class Executor(ABC):
    def __init__(self, engine_config: EngineConfig, encoder_connector_worker: Any = None) -> None:
        self.config = engine_config
        self._init_workers(encoder_connector_worker)
        self.collective_rpc("load_model")
        # Every rank holds the same number of blocks: the smallest pool wins.
        self.num_blocks: int = min(self.collective_rpc("determine_num_blocks"))
        self.collective_rpc("initialize_cache", self.num_blocks)
        self.kv_cache_spec: KVCacheSpec = self.collective_rpc("get_kv_cache_spec")[0]

    @property
    def block_bytes(self) -> int:
        """KV bytes of one block on one rank (all layers, scales included)."""
        return self.kv_cache_spec.block_bytes

    @abstractmethod
    def _init_workers(self, encoder_connector_worker: Any) -> None:
        """Start one worker per rank (ParallelConfig.world_size)."""

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call `method(*args)` on every worker; results in rank order."""

    def execute(self, plan: StepPlan, mm_payloads: dict[str, dict] | None = None
                ) -> ModelRunnerOutput:
        """Run one step on every rank. mm_payloads: mm_hash -> the array data
        (pixels) of each item the plan encodes this step."""
        return self.collective_rpc("execute", plan, mm_payloads or {})[0]

    def shutdown(self) -> None:
        self.collective_rpc("shutdown")
