"""The tensor-parallel group this process belongs to, and its collectives.

A worker joins a group once (`init_tensor_parallel_group`) after
torch.distributed is initialized; layers ask `get_tp_group()` for their rank
and size and call its collectives. Before that (one process, tp_size=1) the
group is rank 0 of 1 and the collectives are identities, so tp_size=1 runs the
same layer code.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ProcessGroup:
    """A set of ranks that run collectives together.

    rank / world_size are positions within this group; `device_group` is the
    torch.distributed group (None for the single-process group).
    """

    rank: int = 0
    world_size: int = 1
    device_group: Any = None

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group's ranks (in place when world_size > 1)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """`obj` from rank `src` on every rank (plain, picklable data)."""
        if self.world_size == 1:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src, group=self.device_group)
        return holder[0]


_TP_GROUP = ProcessGroup()


def init_tensor_parallel_group(tensor_parallel_size: int) -> ProcessGroup:
    """Join this process's tensor-parallel group (torch.distributed must be
    initialized; consecutive world ranks form one group)."""
    global _TP_GROUP
    if tensor_parallel_size == 1:
        _TP_GROUP = ProcessGroup()
        return _TP_GROUP
    world_rank = dist.get_rank()
    first = world_rank - world_rank % tensor_parallel_size
    ranks = list(range(first, first + tensor_parallel_size))
    _TP_GROUP = ProcessGroup(rank=world_rank - first, world_size=tensor_parallel_size,
                             device_group=dist.new_group(ranks))
    return _TP_GROUP


@contextmanager
def single_rank_layers() -> Iterator[None]:
    """Layers built inside hold whole weights and run no collectives, whatever
    the group: a module replicated on every rank (a data-parallel vision encoder)."""
    global _TP_GROUP
    group, _TP_GROUP = _TP_GROUP, ProcessGroup()
    try:
        yield
    finally:
        _TP_GROUP = group


def get_tp_group() -> ProcessGroup:
    return _TP_GROUP


def get_tp_rank() -> int:
    return _TP_GROUP.rank


def get_tp_size() -> int:
    return _TP_GROUP.world_size


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _TP_GROUP.all_reduce(x)


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _TP_GROUP.all_gather(x, dim)
