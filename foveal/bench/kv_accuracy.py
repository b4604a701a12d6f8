"""What a quantized KV cache costs in accuracy, measured by teacher forcing.

The reference engine (float KV) writes a greedy continuation of each prompt.
Every engine under test is then made to follow exactly those tokens (its
sampler is replaced by one that records the logits and returns the reference
token), so each decode position sees the same prefix in both runs and its
logits can be compared: top-1 agreement (the quantized argmax equals the
reference token) and the mean |logit difference|.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from foveal.sampling_params import SamplingParams
from foveal.worker.sampler import SamplerOutput


class ForcingSampler:
    """Returns the given tokens in order (batch of one) and keeps each step's logits."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = iter(token_ids)
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, params, generators) -> SamplerOutput:
        if logits.shape[0] != 1:
            raise RuntimeError("teacher forcing runs one request at a time")
        self.logits.append(logits[0].float().cpu())
        return SamplerOutput([next(self.token_ids)], [None])


def forced_logits(llm, prompt: dict, token_ids: list[int]) -> torch.Tensor:
    """(len(token_ids), vocab) logits of `llm` predicting each of token_ids after
    the prompt and the tokens before it."""
    sampling = llm.llm_engine.core.executor.model_runner.sampling
    original, sampling.sampler = sampling.sampler, ForcingSampler(token_ids)
    try:
        llm.generate(prompt, SamplingParams(max_tokens=len(token_ids), ignore_eos=True),
                     use_tqdm=False)
        return torch.stack(sampling.sampler.logits)
    finally:
        sampling.sampler = original


@dataclass
class Agreement:
    positions: int
    top1_agreement: float  # fraction of positions whose argmax is the reference token
    mean_abs_logit_diff: float

    def as_dict(self) -> dict:
        return {"positions": self.positions, "top1_agreement": self.top1_agreement,
                "mean_abs_logit_diff": self.mean_abs_logit_diff}


def reference_run(llm, prompts: list[dict], num_tokens: int
                  ) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: the greedy continuation and its logits, from the reference
    engine, one request at a time (as the forced runs go)."""
    greedy = SamplingParams(max_tokens=num_tokens, ignore_eos=True, temperature=0.0)
    reference = []
    for prompt in prompts:
        ids = list(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)
        reference.append((ids, forced_logits(llm, prompt, ids)))
    return reference


def agreement(llm, prompts: list[dict], reference: list[tuple[list[int], torch.Tensor]]
              ) -> Agreement:
    """Teacher-forced agreement of `llm` with the reference run."""
    agree = positions = 0
    diff = 0.0
    for prompt, (token_ids, ref_logits) in zip(prompts, reference):
        logits = forced_logits(llm, prompt, token_ids)  # (N, vocab)
        agree += int((logits.argmax(dim=-1) == torch.tensor(token_ids)).sum())
        diff += float((logits - ref_logits).abs().mean(dim=-1).sum())
        positions += len(token_ids)
    return Agreement(positions, agree / positions, diff / positions)
