"""Tensor-parallel rank and size, read from torch.distributed.

When torch.distributed is not initialized the process is rank 0 of 1 and the
collectives are identities, so tp_size=1 runs the same layer code.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _distributed_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_tp_rank() -> int:
    return dist.get_rank() if _distributed_ready() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if _distributed_ready() else 1


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks (in place when tp > 1)."""
    if get_tp_size() > 1:
        dist.all_reduce(x)
    return x


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    world = get_tp_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
