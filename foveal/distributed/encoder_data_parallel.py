"""A data-parallel vision encoder: each rank encodes a share of the step's
media items with its whole copy of the (small) encoder, then every rank gets
every item's embeddings (one all-gather). Small ViTs gain more this way than
from sharding their weights: no collective inside the encoder, and the
ranks' matmuls are full-width."""
from __future__ import annotations

from typing import Callable

import torch

from foveal.distributed.parallel_state import get_tp_group


def balanced_shares(sizes: list[int], num_ranks: int) -> list[list[int]]:
    """Item indices per rank, largest items first onto the least-loaded rank
    (ties: lower rank); each share in item order. Same answer on every rank."""
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += sizes[index]
    return [sorted(share) for share in shares]


def encode_across_ranks(encode: Callable[[list[int]], list[torch.Tensor]], sizes: list[int],
                        hidden: int, device: torch.device, dtype: torch.dtype
                        ) -> list[torch.Tensor]:
    """encode(indices) -> this rank's items' embeddings (sizes[i], hidden) each;
    returns all items' embeddings on every rank. If any rank's share fails, every
    rank raises (after the same collectives), so the caller's per-item retry runs
    in step on all ranks."""
    group = get_tp_group()
    shares = balanced_shares(sizes, group.world_size)
    mine = shares[group.rank]
    rows = max(sum(sizes[i] for i in share) for share in shares)
    local = torch.zeros(rows, hidden, device=device, dtype=dtype)  # padded to the largest share
    failure = None
    try:
        if mine:
            out = torch.cat(encode(mine))
            local[:out.shape[0]] = out.to(dtype)
    except Exception as error:  # noqa: BLE001 - re-raised below, on every rank alike
        failure = error
    failed = group.all_reduce(torch.tensor([0.0 if failure is None else 1.0], device=device))
    gathered = group.all_gather(local, dim=0)  # (world * rows, hidden)
    if float(failed) > 0:
        raise RuntimeError("a media item failed to encode on a tensor-parallel rank") \
            from failure
    result: list[torch.Tensor | None] = [None] * len(sizes)
    for rank, share in enumerate(shares):
        offset = rank * rows
        for index in share:
            result[index] = gathered[offset:offset + sizes[index]]
            offset += sizes[index]
    return result
