"""Parallel state: tensor-parallel rank/size and the collectives layers use."""
from foveal.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_parallel_all_gather,
    tensor_parallel_all_reduce,
)

__all__ = ["get_tp_rank", "get_tp_size", "tensor_parallel_all_gather", "tensor_parallel_all_reduce"]
