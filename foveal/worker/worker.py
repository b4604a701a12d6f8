"""One rank's worker: its device, its share of the model, its KV pool and model runner.

An executor owns one worker per rank and drives them all the same way:
load_model, determine_num_blocks (each rank measures its own memory; the
executor takes the minimum), initialize_cache, then execute once per step with
the same StepPlan on every rank.
"""
from __future__ import annotations

from typing import Any

from foveal.config import EngineConfig
from foveal.distributed import get_tp_size
from foveal.engine.plan import ModelRunnerOutput, StepPlan
from foveal.errors import EngineDeadError
from foveal.layers.attention.kv_spec import KVCacheSpec
from foveal.layers.linear import prepack_weights
from foveal.worker.kv_cache import available_kv_memory, kv_cache_spec
from foveal.worker.kv_offload import KVOffloadWorker
from foveal.worker.model_runner import ModelRunner


class Worker:
    def __init__(self, engine_config: EngineConfig, rank: int = 0,
                 encoder_connector: Any = None) -> None:
        """encoder_connector: the worker half of an encoder connector
        (foveal/worker/encoder_connector.py), or None."""
        self.config = engine_config
        self.rank = rank
        self.encoder_connector = encoder_connector
        self.model = None
        self.model_runner: ModelRunner | None = None
        self.kv_cache_spec: KVCacheSpec = kv_cache_spec(
            engine_config.model, engine_config.cache, engine_config.dtype, get_tp_size())

    def load_model(self) -> None:
        from foveal.loader.weights import load_model

        self.model = load_model(self.config)
        prepack_weights(self.model)  # CPU fp32: oneDNN-blocked GEMM weights

    def determine_num_blocks(self) -> int:
        """Blocks this rank's memory holds; call after load_model, so free
        device memory already excludes the weights."""
        memory_bytes = available_kv_memory(self.config.cache, self.config.device)
        return self.kv_cache_spec.num_blocks_for(memory_bytes,
                                                 self.config.scheduler.max_model_len)

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.kv_cache_spec

    def initialize_cache(self, num_blocks: int) -> None:
        kv_caches = self.kv_cache_spec.allocate(num_blocks, self.config.device)
        kv_offload = (KVOffloadWorker.from_config(self.config.cache, kv_caches)
                      if self.config.cache.kv_offload else None)
        self.model_runner = ModelRunner(self.config, self.model, kv_caches, kv_offload,
                                        self.encoder_connector)

    def execute(self, plan: StepPlan, mm_payloads: dict[str, dict] | None = None
                ) -> ModelRunnerOutput:
        if self.model_runner is None:
            raise EngineDeadError("the worker was shut down; start a new engine")
        return self.model_runner.execute(plan, mm_payloads or {})

    def shutdown(self) -> None:
        """Drop the model and the KV cache so their memory can be reused."""
        self.model_runner = None
        self.model = None
