"""Tensor parallelism on Ray: one actor per rank, placed by a placement group,
so one model can span the hosts of a Ray cluster (`ray start --head` on one,
`ray start --address HEAD:6379` on the others, then RAY_ADDRESS=auto or the
head's address for the engine; without one, a local Ray instance is started).

Each actor joins torch.distributed (gloo on CPU, NCCL on CUDA) at rank 0's
node address, then builds its Worker, as the `mp` executor's processes do.
Every call has a deadline; a dead actor or a timeout raises EngineDeadError.
"""
from __future__ import annotations

import os
from typing import Any

from foveal.config import EngineConfig
from foveal.errors import ConfigError, EngineDeadError
from foveal.executor.base import Executor
from foveal.executor.ranks import (call_timeout_s, check_no_encoder_connector, free_port,
                                   is_start_error, rank_reply, start_rank, startup_timeout_s)
from foveal.logger import init_logger

logger = init_logger(__name__)


class RayWorker:
    """The actor body: one rank's Worker behind Ray calls."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, threads: int) -> None:
        self.config, self.rank, self.world_size, self.threads = config, rank, world_size, threads
        self.worker = None

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def start(self, init_method: str, collective_timeout_s: float) -> None:
        # Ray gives each actor its own visible GPU: device 0 here.
        self.worker = start_rank(self.config, self.rank, self.world_size, init_method,
                                 collective_timeout_s, self.threads, cuda_device=0)

    def call(self, method: str, args: tuple) -> Any:
        return rank_reply(self.rank, method, getattr(self.worker, method)(*args))


class RayExecutor(Executor):
    def _init_workers(self, encoder_connector_worker: Any) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ConfigError("--distributed-executor-backend ray needs Ray: "
                              "pip install 'foveal[ray]'") from None
        check_no_encoder_connector(encoder_connector_worker)
        self._ray = ray
        self._actors: list[Any] = []
        self._group = None
        self._dead = False
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        world_size = self.config.parallel.world_size
        cuda = self.config.device.startswith("cuda")
        threads = 1 if cuda else max(1, int(ray.available_resources().get("CPU", world_size))
                                     // world_size)
        bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": threads}
        self._group = placement_group([bundle] * world_size, strategy="PACK")
        startup = startup_timeout_s()
        try:
            ray.get(self._group.ready(), timeout=startup)
            actor_class = ray.remote(RayWorker)
            self._actors = [actor_class.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=rank),
            ).remote(self.config, rank, world_size, threads) for rank in range(world_size)]
            host, port = ray.get(self._actors[0].address.remote(), timeout=startup)
            self._get([actor.start.remote(f"tcp://{host}:{port}",
                                          self.config.parallel.collective_timeout_s)
                       for actor in self._actors], "start", startup)
        except Exception:
            self._kill()
            raise
        logger.info("tensor parallel on Ray: %d actors (%s), %d threads each", world_size,
                    "nccl" if cuda else "gloo", threads)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        if self._dead:
            raise EngineDeadError("a tensor-parallel worker failed earlier; start a new engine")
        return self._get([actor.call.remote(method, args) for actor in self._actors], method,
                         call_timeout_s(method))

    def _get(self, refs: list, method: str, timeout_s: float) -> list[Any]:
        ray = self._ray
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._fail(f"a rank did not answer {method} within {timeout_s:.0f} s")
        except ray.exceptions.RayActorError as error:
            self._fail(f"a rank's actor died during {method}: {error}", error)
        except ray.exceptions.RayTaskError as error:
            cause = error.as_instanceof_cause()
            if is_start_error(cause, method):
                self._kill()
                raise cause from None  # a typed error at start (ConfigError, CheckpointError)
            self._fail(f"{method} failed on a tensor-parallel rank: {cause}", error)

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        self._kill()
        raise EngineDeadError(message) from cause

    def shutdown(self) -> None:
        if not self._dead:
            try:
                self.collective_rpc("shutdown")
            except EngineDeadError:
                pass
        self._kill()

    def _kill(self) -> None:
        ray = self._ray
        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors = []
        if getattr(self, "_group", None) is not None:
            try:
                ray.util.remove_placement_group(self._group)
            except Exception:  # noqa: BLE001
                pass
            self._group = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._dead = True
