"""Draft verification: keep the longest run of drafts the target agrees with.

The target scores the last known token and the k drafts in one forward: rows
0..k of its logits predict the token after each. Greedy requests keep drafts
while they equal the target's argmax, then take the target's token. Sampling
requests use rejection sampling against the draft's distribution q (a point
mass on the draft for proposers without one, such as n-gram): draft d_i is
kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the
token comes from the residual max(p_i - q_i, 0), renormalized; after k
acceptances a bonus token comes from p_k. The kept tokens are distributed
exactly as the target would sample them one at a time.
"""
from __future__ import annotations

import torch

from foveal.sampling_params import SamplingParams
from foveal.worker.sampler import target_probs


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """logits (k+1, V) -> accepted drafts + one target token."""
    targets = logits.argmax(dim=-1).tolist()  # (k+1,)
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return drafts[:accepted] + [targets[accepted]]


def verify_sampled(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                   generator: torch.Generator | None,
                   draft_probs: torch.Tensor | None = None) -> list[int]:
    """logits (k+1, V), draft_probs (k, V) or None (point masses on the drafts)."""
    probs = target_probs(logits, [params] * logits.shape[0])  # (k+1, V)
    k = len(drafts)
    draft_ids = torch.tensor(drafts, dtype=torch.long, device=logits.device)  # (k,)
    rows = torch.arange(k, device=logits.device)
    p_draft = probs[rows, draft_ids]  # (k,)
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs[rows, draft_ids]
    uniform = torch.rand(k, generator=generator, device=logits.device)  # (k,)
    rejected = (uniform * q_draft >= p_draft).nonzero()
    if len(rejected) == 0:
        return drafts + [_draw(probs[k], generator)]
    first = int(rejected[0])
    q_row = (torch.zeros_like(probs[first]).scatter_(0, draft_ids[first:first + 1], 1.0)
             if draft_probs is None else draft_probs[first])
    residual = (probs[first] - q_row).clamp_(min=0)
    if float(residual.sum()) <= 0:  # p == q on this row: nothing to correct
        residual = probs[first]
    return drafts[:first] + [_draw(residual, generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights / weights.sum(), 1, generator=generator))
