"""Single-process executor: one worker in the engine's own process."""
from __future__ import annotations

from foveal.config import EngineConfig
from foveal.engine.core import EngineCore
from foveal.engine.plan import ModelRunnerOutput, StepPlan
from foveal.errors import EngineDeadError
from foveal.layers.linear import prepack_weights
from foveal.worker.device import torch_dtype
from foveal.worker.kv_cache import (allocate_kv_caches, available_kv_memory,
                                    kv_cache_bytes_per_block, num_blocks_for)
from foveal.worker.kv_offload import KVOffloadWorker
from foveal.worker.model_runner import ModelRunner


class UniProcExecutor:
    """Loads the model, sizes and allocates the KV cache, runs plans."""

    def __init__(self, engine_config: EngineConfig) -> None:
        from foveal.loader.weights import load_model

        model = load_model(engine_config)
        prepack_weights(model)  # CPU fp32: oneDNN-blocked GEMM weights
        model_config = engine_config.model
        block_size = engine_config.cache.block_size
        dtype = torch_dtype(engine_config.dtype)
        # Sized after loading, so free device memory already excludes the weights.
        memory_bytes = available_kv_memory(engine_config.cache, engine_config.device)
        self.num_blocks = num_blocks_for(memory_bytes, model_config, block_size, dtype,
                                         engine_config.scheduler.max_model_len)
        self.block_bytes = kv_cache_bytes_per_block(model_config, block_size, dtype)
        kv_caches = allocate_kv_caches(self.num_blocks, block_size, model_config, dtype,
                                       engine_config.device)
        kv_offload = (KVOffloadWorker.from_config(engine_config.cache, kv_caches)
                      if engine_config.cache.kv_offload else None)
        self.model_runner: ModelRunner | None = ModelRunner(
            engine_config, model, kv_caches, block_size, kv_offload)

    def execute(self, plan: StepPlan) -> ModelRunnerOutput:
        if self.model_runner is None:
            raise EngineDeadError("the executor was shut down; start a new engine")
        return self.model_runner.execute(plan)

    def shutdown(self) -> None:
        """Drop the model and the KV cache so their memory can be reused."""
        self.model_runner = None


def build_engine_core(engine_config: EngineConfig) -> EngineCore:
    """Executor + scheduler sized to the KV pool it allocated, as one EngineCore."""
    from foveal.engine.scheduler import Scheduler

    executor = UniProcExecutor(engine_config)
    scheduler = Scheduler(engine_config.scheduler, engine_config.cache, executor.num_blocks,
                          executor.block_bytes)
    return EngineCore(scheduler, executor)
