"""Parallel state: the tensor-parallel process group and the collectives layers use."""
from foveal.distributed.parallel_state import (
    ProcessGroup,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    init_tensor_parallel_group,
    single_rank_layers,
    tensor_parallel_all_gather,
    tensor_parallel_all_reduce,
)

__all__ = ["ProcessGroup", "get_tp_group", "get_tp_rank", "get_tp_size",
           "init_tensor_parallel_group", "single_rank_layers", "tensor_parallel_all_gather",
           "tensor_parallel_all_reduce"]
