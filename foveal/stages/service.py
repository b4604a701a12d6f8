"""`StagePools`: the engine's handle on every preprocessing stage.

    stages = StagePools({"ocr": 2, "asr": 1})          # or StagePools(StagesConfig(...))
    result = await stages.run("ocr", OcrItem(png))     # asyncio
    result = stages.run_sync("ocr", OcrItem(png))      # blocking

Each stage is served by a local worker pool (default) or by remote
endpoints (`StagesConfig.endpoints`), both created on first use. In front
of both sits one content-hash cache: a repeated input (same bytes, same
parameters) is answered without reaching a worker, and identical items
already in flight share one computation. Futures are thread-safe, so
stage work of one request runs concurrently with other requests' work.
When every caller waiting on a queued item has been cancelled (its client
went away), the item is cancelled and leaves the queue; one already running
finishes and is cached (a retry of the same input finds it).
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Any, Mapping

from foveal.stages import load_stage_class, stage_target
from foveal.stages.cache import ResultCache
from foveal.stages.config import StagesConfig, parse_stage_workers
from foveal.stages.metrics import StageMetrics


class StagePools:
    def __init__(self, config: StagesConfig | Mapping[str, int] | str | None = None) -> None:
        if not isinstance(config, StagesConfig):
            config = StagesConfig(workers=parse_stage_workers(config))
        self.config = config
        self.cache = ResultCache(config.cache_max_bytes)
        self._stages: dict[str, Any] = {}  # name -> Stage, built in this process for cache keys
        self._backends: dict[str, Any] = {}  # name -> LocalStagePool | RemoteStage
        self._metrics: dict[str, StageMetrics] = {}
        self._in_flight: dict[str, Future] = {}
        self._num_waiting: dict[Future, int] = {}  # callers of each future not yet done
        self._lock = threading.RLock()  # reentrant: a future cancelled under it runs _finish

    async def run(self, stage: str, item: Any) -> Any:
        """The stage's result for `item`; raises the stage's typed error."""
        future = self.submit(stage, item)
        try:
            # shielded: a cancelled request must not cancel work another request shares
            return await asyncio.shield(asyncio.wrap_future(future))
        finally:
            self._leave(future)

    def run_sync(self, stage: str, item: Any) -> Any:
        future = self.submit(stage, item)
        try:
            return future.result()
        finally:
            self._leave(future)

    def _leave(self, future: Future) -> None:
        """A caller stops waiting; the last one to leave cancels a job still queued."""
        with self._lock:  # so that no caller joins a future being cancelled
            num_waiting = self._num_waiting.get(future, 0) - 1
            if num_waiting > 0:
                self._num_waiting[future] = num_waiting
            else:
                self._num_waiting.pop(future, None)
                future.cancel()  # no-op once a worker has it

    def submit(self, stage: str, item: Any) -> Future:
        """A future for the result: done at once on a cache hit; raises
        StageOverloadedError now (not in the future) when the stage's queue is full."""
        backend = self._backend(stage)
        metrics = self._metrics[stage]
        key = self._stages[stage].cache_key(item)
        with self._lock:
            shared = self._in_flight.get(key)
            cached = self.cache.get(key) if shared is None else None
            if shared is not None:
                self._num_waiting[shared] = self._num_waiting.get(shared, 0) + 1
            if shared is not None or cached is not None:
                metrics.count("cache_hits")
                return shared or _done(cached)
            metrics.count("cache_misses")
            future = backend.submit(item)
            self._in_flight[key] = future
            self._num_waiting[future] = 1
        started = time.monotonic()
        future.add_done_callback(lambda done: self._finish(stage, key, done, started))
        return future

    def _finish(self, stage: str, key: str, future: Future, started: float) -> None:
        ok = not future.cancelled() and future.exception() is None
        with self._lock:
            self._in_flight.pop(key, None)
            self._num_waiting.pop(future, None)
            if ok:
                self.cache.put(key, future.result())
        if future.cancelled():
            self._metrics[stage].count("cancelled")
        else:
            self._metrics[stage].observe(time.monotonic() - started, ok)

    def warm_up(self, *stages: str) -> None:
        """Start the named stages' workers now (models loaded), e.g. before serving traffic."""
        for stage in stages:
            self._backend(stage).warm_up()

    def stage(self, name: str) -> Any:
        """The `Stage` object for `name` (its item_type, result_type, options)."""
        self._backend(name)
        return self._stages[name]

    def backend(self, stage: str) -> Any:
        """The stage's LocalStagePool or RemoteStage (started on first use)."""
        return self._backend(stage)

    def _backend(self, stage: str) -> Any:
        with self._lock:
            if stage not in self._backends:
                self._backends[stage] = self._create_backend(stage)
            return self._backends[stage]

    def _create_backend(self, stage: str) -> Any:
        target = stage_target(stage)
        options = self.config.options_for(stage)
        stage_obj = load_stage_class(target)(**options)  # validates options before any worker starts
        metrics = StageMetrics(stage)
        self._stages[stage], self._metrics[stage] = stage_obj, metrics
        urls = self.config.endpoints.get(stage)
        if urls:
            from foveal.stages.remote import RemoteStage

            return RemoteStage(stage, stage_obj.result_type, tuple(urls),
                               queue_size=self.config.queue_size, timeout_s=self.config.timeout_s,
                               health_interval_s=self.config.health_interval_s, metrics=metrics)
        from foveal.stages.pool import LocalStagePool

        return LocalStagePool(stage, target, options, num_workers=self.config.num_workers(stage),
                              queue_size=self.config.queue_size, timeout_s=self.config.timeout_s,
                              max_batch_size=stage_obj.max_batch_size, metrics=metrics)

    def get_metrics(self) -> dict[str, float]:
        stats: dict[str, float] = {
            "foveal:stage_cache_entries": len(self.cache),
            "foveal:stage_cache_bytes": self.cache.nbytes,
        }
        with self._lock:
            backends = dict(self._backends)
        for stage, backend in backends.items():
            stats.update(self._metrics[stage].as_dict(backend.queue_depth(), backend.num_workers))
        return stats

    def close(self) -> None:
        with self._lock:
            backends, self._backends = list(self._backends.values()), {}
        for backend in backends:
            backend.close()

    def __enter__(self) -> "StagePools":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def stage_pools_for(stages: Any) -> tuple[StagePools, bool]:
    """(pools, owned): a StagePools is used as given (its creator closes it); anything
    else (StagesConfig, {"asr": 2}, "ocr=2,asr=1", None) configures new pools that
    the caller owns and closes."""
    if isinstance(stages, StagePools):
        return stages, False
    return StagePools(stages), True


def _done(result: Any) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future
