"""EAGLE proposer: a draft head over the target's features, with its own paged KV.

Each step, after the target's forward and sampling:
1. Catch-up: the head runs over every token the target just computed, with the
   same attention layout (block tables, slots, positions): the input at
   position p is the target's feature at p and the token at p + 1. Rows whose
   next token is not known (rejected drafts) are computed and later
   overwritten, like the target's own KV of rejected drafts.
2. Chain: for each request that asked for drafts, the row of its last known
   position gives draft 1; each further draft feeds the head its own output
   feature and previous draft, one position on. Chain positions beyond the
   request's blocks write to scratch blocks after the pool, so the scheduler
   allocates nothing for them.
Drafts are greedy (argmax), so verification treats them as point masses and
sampling stays exact (verify.py).

The head's KV shares the target's block ids: a prefix-cache hit or a resumed
request finds the head's KV for its cached blocks where it left it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from foveal.config import SpeculativeConfig
from foveal.forward_context import AttentionMetadata, block_table_array, forward_context

if TYPE_CHECKING:
    from foveal.engine.plan import ModelRunnerOutput
    from foveal.worker.model_runner import Batch, ScheduledRequest


def draft_cache_block_bytes(head: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of the head's KV takes on this rank (keys and values, one layer)."""
    attn = head.layer.attn  # this rank's KV heads: tensor parallelism shards them
    return 2 * block_size * attn.num_kv_heads * attn.head_dim * dtype.itemsize


class EagleProposer:
    reads_hidden_states = True

    def __init__(self, config: SpeculativeConfig, head: torch.nn.Module,
                 target: torch.nn.Module, num_blocks: int, block_size: int,
                 max_num_seqs: int, device: torch.device, dtype: torch.dtype) -> None:
        self.head = head
        self.target = target
        self.num_tokens = config.num_speculative_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.scratch_per_request = -(-self.num_tokens // block_size) + 1
        attn = head.layer.attn  # this rank's share of the KV heads
        total = num_blocks + max_num_seqs * self.scratch_per_request
        self.kv_cache = torch.zeros(2, total, block_size, attn.num_kv_heads, attn.head_dim,
                                    dtype=dtype, device=device)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.config.aux_layer_ids

    def propose(self, batch: "Batch", scheduled: list["ScheduledRequest"],
                features: torch.Tensor, output: "ModelRunnerOutput") -> None:
        """features (T, F): the target's features of this step's T tokens (EAGLE-3:
        its aux layers; EAGLE-1: its final hidden states). Sampling has already
        extended each sampled request's token_ids."""
        head = self.head
        next_ids = self._next_token_ids(scheduled)  # (T,)
        with forward_context(batch.attn_metadata, [self.kv_cache]):
            scored, next_features = head(self._embed(next_ids), head.combine(features),
                                         batch.positions)
        sampled = {id(item) for item in batch.sampled}
        wanted = [(i, item) for i, item in enumerate(scheduled)
                  if id(item) in sampled and item.state.sampling_params.speculative_decoding]
        if not wanted:
            return
        starts = batch.attn_metadata.query_start_loc_cpu
        rows = torch.tensor([starts[i] + len(item.state.token_ids) - 2
                             - (item.state.num_computed_tokens - item.num_new_tokens)
                             for i, item in wanted], device=self.device)  # (R,)
        items = [item for _, item in wanted]
        drafts = self._chain(items, scored[rows], next_features[rows],
                             batch.positions[..., rows])  # (R, k)
        for item, run in zip(items, drafts.tolist()):
            output.spec_token_ids[item.state.request_id] = run

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.head.embed_tokens is not None:
            return self.head.embed_tokens(token_ids)
        return self.target.embed_input_ids(token_ids)

    def _next_token_ids(self, scheduled: list["ScheduledRequest"]) -> torch.Tensor:
        """The token after each computed position (0 where none is known yet)."""
        ids = []
        for item in scheduled:
            tokens = item.state.token_ids
            start = item.state.num_computed_tokens - item.num_new_tokens
            known = tokens[start + 1:start + 1 + item.num_new_tokens]
            ids.extend(known + [0] * (item.num_new_tokens - len(known)))
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _chain(self, items: list["ScheduledRequest"], scored: torch.Tensor,
               features: torch.Tensor, last_positions: torch.Tensor) -> torch.Tensor:
        """Draft k tokens per request from its last catch-up row -> (R, k) target ids."""
        head = self.head
        lm_head = self.target.lm_head
        token = head.draft_token_ids(scored, lm_head)  # (R,)
        drafts = [token]
        base = np.array([len(item.state.token_ids) - 2 for item in items])  # (R,)
        tables = self._block_tables(items, base + self.num_tokens - 1)
        for step in range(1, self.num_tokens):
            index = base + step  # (R,) position index of this draft input
            metadata = self._chain_metadata(index, tables)
            with forward_context(metadata, [self.kv_cache]):
                scored, features = head(self._embed(token), features, last_positions + step)
            token = head.draft_token_ids(scored, lm_head)
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    def _block_tables(self, items: list["ScheduledRequest"], last_index: np.ndarray
                      ) -> np.ndarray:
        """(R, blocks) each request's blocks, then scratch blocks up to last_index."""
        rows = []
        for r, (item, last) in enumerate(zip(items, last_index.tolist())):
            blocks = list(item.state.block_ids[0])  # group 0: full attention
            extra = last // self.block_size + 1 - len(blocks)
            first = self.num_blocks + r * self.scratch_per_request
            rows.append(blocks + list(range(first, first + max(0, extra))))
        return block_table_array(rows)

    def _chain_metadata(self, index: np.ndarray, tables: np.ndarray) -> AttentionMetadata:
        """One query per request at position `index`, over positions 0..index."""
        count = len(index)
        slots = (tables[np.arange(count), index // self.block_size].astype(np.int64)
                 * self.block_size + index % self.block_size)
        return AttentionMetadata.from_arrays(slots, np.arange(count + 1), index + 1, tables,
                                             self.block_size, self.device)
