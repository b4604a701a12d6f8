"""Executors, as a registry with lazy imports, and the engine-core builder.

An executor runs the workers (one per tensor-parallel rank) and hands them
each step's plan. "uni" runs one worker in the engine's own process; executors
for local processes and Ray register here under their own names.
"""
from __future__ import annotations

from typing import Any

from foveal.config import EngineConfig
from foveal.engine.core import EngineCore
from foveal.errors import ConfigError
from foveal.lazy_import import resolve
from foveal.logger import init_logger

logger = init_logger(__name__)

# name -> "module:Class", imported on first use
_EXECUTORS: dict[str, str] = {"uni": "foveal.executor.uniproc:UniProcExecutor",
                              "mp": "foveal.executor.multiproc:MultiprocExecutor",
                              "ray": "foveal.executor.ray_executor:RayExecutor"}


def register_executor(name: str, target: str) -> None:
    """Register `target` ("package.module:Class", an Executor subclass) as `name`."""
    _EXECUTORS[name] = target


def executor_names() -> list[str]:
    return sorted(_EXECUTORS)


def get_executor_class(name: str) -> type:
    if name not in _EXECUTORS:
        raise ConfigError(f"executor {name!r} is unknown; registered: {executor_names()} "
                          "(--distributed-executor-backend)")
    return resolve(_EXECUTORS[name])


def build_engine_core(engine_config: EngineConfig, encoder_connector: Any = None,
                      encoder_connector_worker: Any = None) -> EngineCore:
    """Executor + scheduler sized to the KV pool the workers allocated; for
    role "encode", an EncodeCore (foveal/disagg/encode_core.py) instead.

    encoder_connector / encoder_connector_worker: the scheduler and worker
    halves of an encoder-output connector (foveal/engine/encoder_connector.py),
    injected together, or neither.
    """
    from foveal.engine.scheduler import build_scheduler

    executor_class = get_executor_class(engine_config.parallel.distributed_executor_backend)
    executor = executor_class(engine_config, encoder_connector_worker)
    if engine_config.transfer.role == "encode":
        from foveal.disagg.encode_core import EncodeCore

        return EncodeCore(executor, engine_config.scheduler.encoder_compute_budget)
    spec = executor.kv_cache_spec
    scheduler = build_scheduler(engine_config.scheduler, engine_config.cache,
                                executor.num_blocks, executor.block_bytes, encoder_connector,
                                spec.groups)
    logger.info("KV cache: %s tokens (%s), %.2f GiB per rank",
                f"{scheduler.stats.kv_cache_capacity_tokens:,}", spec.dtype_name,
                executor.num_blocks * spec.block_bytes / (1 << 30))
    if spec.groups is not None:
        logger.info("sliding-window layers take their own blocks, freed once out of the "
                    "window: %s", spec.groups.describe())
    return EngineCore(scheduler, executor)


__all__ = ["build_engine_core", "executor_names", "get_executor_class", "register_executor"]
