"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous slice of the vocabulary rows. The embedding
zeroes rows it does not own and sums over ranks; the head gathers logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foveal.distributed import (
    get_tp_rank,
    get_tp_size,
    tensor_parallel_all_gather,
    tensor_parallel_all_reduce,
)
from foveal.layers.linear import apply_linear, check_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // self.tp_size)  # ceil: last rank may pad
        self.vocab_start = self.rows_per_rank * self.tp_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        rows = loaded_weight[self.vocab_start:self.vocab_end]
        target = param.data[: rows.shape[0]]
        check_shape(target, rows, "embedding")
        target.copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # (T, hidden)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # (T,)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        embeds = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1)  # (T, hidden)
        return tensor_parallel_all_reduce(embeds)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> vocab logits; shares the embedding's weight when tied."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tied_embedding: VocabParallelEmbedding | None = None):
        super().__init__(num_embeddings, embedding_dim)
        if tied_embedding is not None:
            self.weight = tied_embedding.weight
        self.packed_weight: torch.Tensor | None = None  # set by prepack_weights()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = apply_linear(hidden_states, self, None)  # (N, vocab / tp)
        logits = tensor_parallel_all_gather(logits, dim=-1)  # (N, padded vocab)
        return logits[..., : self.num_embeddings]
