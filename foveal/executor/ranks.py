"""What the executors that run one process per rank share (`mp`, `ray`): bringing
a rank up, what a rank answers, and how long a call may take."""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from foveal.config import EngineConfig
from foveal.errors import EngineDeadError, FovealError

# Calls that load or allocate: they may take as long as loading a checkpoint.
SLOW_METHODS = ("load_model", "determine_num_blocks", "initialize_cache")
# Calls whose typed errors (ConfigError, CheckpointError) reach the caller as themselves.
START_METHODS = ("start", "load_model", "determine_num_blocks")


def startup_timeout_s() -> float:
    """FOVEAL_WORKER_STARTUP_TIMEOUT_S (600 s) bounds start and loading."""
    return float(os.environ.get("FOVEAL_WORKER_STARTUP_TIMEOUT_S", 600))


def call_timeout_s(method: str) -> float:
    """Loading calls: the startup bound; every other call, a step included:
    FOVEAL_WORKER_STEP_TIMEOUT_S (300 s)."""
    if method in SLOW_METHODS:
        return startup_timeout_s()
    return float(os.environ.get("FOVEAL_WORKER_STEP_TIMEOUT_S", 300))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_no_encoder_connector(encoder_connector_worker: Any) -> None:
    if encoder_connector_worker is not None:
        raise FovealError("an encoder connector's worker half runs in one process; "
                          "use tensor_parallel_size=1 with it")


def start_rank(config: EngineConfig, rank: int, world_size: int, init_method: str,
               collective_timeout_s: float, threads: int, cuda_device: int):
    """Join torch.distributed (gloo on CPU, NCCL on CUDA) and the tensor-parallel
    group, then build this rank's Worker."""
    import torch
    import torch.distributed as dist

    from foveal.distributed import init_tensor_parallel_group
    from foveal.worker.worker import Worker

    torch.set_num_threads(threads)
    cuda = config.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(cuda_device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=collective_timeout_s))
    init_tensor_parallel_group(world_size)
    return Worker(config, rank=rank)


def rank_reply(rank: int, method: str, result: Any) -> Any:
    """Only rank 0 sends a step's output back; the others' are the same."""
    return result if rank == 0 or method != "execute" else None


def is_start_error(error: BaseException, method: str) -> bool:
    """A typed error from starting or loading a rank, to re-raise as itself."""
    return (isinstance(error, FovealError) and not isinstance(error, EngineDeadError)
            and method in START_METHODS)
