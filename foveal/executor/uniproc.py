"""One worker in the engine's own process (tensor_parallel_size=1)."""
from __future__ import annotations

from typing import Any

from foveal.executor.base import Executor
from foveal.worker.model_runner import ModelRunner
from foveal.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_workers(self, encoder_connector_worker: Any) -> None:
        self.driver_worker = Worker(self.config, rank=0,
                                    encoder_connector=encoder_connector_worker)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args)]

    @property
    def model_runner(self) -> ModelRunner | None:
        return self.driver_worker.model_runner
