"""Token sampling over a batch of logits with per-request SamplingParams.

Random sampling uses the exponential race: argmax(probs / q) with
q ~ Exp(1) i.i.d. draws token v with probability probs[v]. Each seeded request
draws its q from its own generator, so its tokens do not depend on what else
is in the batch; unseeded requests share the engine generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from foveal.engine.plan import Logprobs
from foveal.sampling_params import SamplingParams

# Exp(1) draws are clamped away from 0 so probs / q stays finite.
_MIN_NOISE = 1e-10


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprobs | None]


def request_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The generator a seeded request owns for its whole life (None: unseeded)."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


class Sampler:
    def __init__(self, seed: int, device: str | torch.device = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SamplerOutput:
        """logits (B, V) float32, raw model output; one params/generator per row."""
        if all(p.greedy for p in params):
            sampled = logits.argmax(dim=-1)  # (B,)
        else:
            sampled = self._sample_random(logits, params, generators)
        return SamplerOutput(sampled.tolist(), compute_logprobs(logits, sampled, params))

    def _sample_random(self, logits: torch.Tensor, params: list[SamplingParams],
                       generators: list[torch.Generator | None]) -> torch.Tensor:
        device = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=device)  # (B,)
        probs = target_probs(logits, params)  # (B, V)
        noise = self._exponential_noise(probs, params, generators)  # (B, V)
        random_tokens = (probs / noise).argmax(dim=-1)  # (B,)
        return torch.where(greedy, logits.argmax(dim=-1), random_tokens)

    def _exponential_noise(self, probs: torch.Tensor, params: list[SamplingParams],
                           generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.ones_like(probs)  # (B, V); greedy rows keep 1 and draw nothing
        shared = [i for i, (p, g) in enumerate(zip(params, generators))
                  if g is None and not p.greedy]
        if shared:
            rows = noise[shared].exponential_(generator=self.generator)  # (S, V)
            noise[shared] = rows
        for i, (p, g) in enumerate(zip(params, generators)):
            if g is not None and not p.greedy:
                noise[i].exponential_(generator=g)
        return noise.clamp_(min=_MIN_NOISE)


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(B, V) logits -> the distribution each row samples from: temperature,
    top-k, top-p, then min-p (greedy rows at temperature 1, unused)."""
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params],
                               dtype=logits.dtype, device=logits.device)  # (B,)
    filtered = apply_top_k_top_p(logits / temperature[:, None], params)  # (B, V)
    return apply_min_p(filtered.softmax(dim=-1), params)  # (B, V)


def apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top_k and top_p nucleus."""
    vocab_size = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    if all(p >= 1.0 for p in top_p):
        if all(k == vocab_size for k in top_k):
            return logits
        return _apply_top_k(logits, top_k)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    ranks = torch.arange(vocab_size, device=logits.device)  # (V,)
    k = torch.tensor(top_k, device=logits.device)  # (B,)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)  # (B, V)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V); 0 for the top token
    p = torch.tensor(top_p, dtype=logits.dtype, device=logits.device)  # (B,)
    sorted_logits = sorted_logits.masked_fill(mass_before >= p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    top_values, _ = logits.topk(max(top_k), dim=-1)  # (B, K) descending
    k = torch.tensor(top_k, device=logits.device)  # (B,)
    kth_value = top_values.gather(-1, (k - 1)[:, None])  # (B, 1)
    return logits.masked_fill(logits < kth_value, float("-inf"))


def apply_min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero tokens whose probability is below min_p times the row's top probability."""
    if all(p.min_p == 0.0 for p in params):
        return probs
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype,
                         device=probs.device)  # (B,)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # (B, 1)
    return probs.masked_fill(probs < threshold, 0.0)


def compute_logprobs(logits: torch.Tensor, sampled: torch.Tensor,
                     params: list[SamplingParams]) -> list[Logprobs | None]:
    """Logprobs of the raw model distribution (before temperature and filters)
    for the rows that asked: the sampled token with its rank, then the top-k."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[Logprobs | None] = [None] * len(params)
    if not rows:
        return result
    logprobs = logits[rows].log_softmax(dim=-1)  # (R, V)
    sampled_rows = sampled[rows][:, None]  # (R, 1)
    sampled_logprob = logprobs.gather(-1, sampled_rows)  # (R, 1)
    ranks = (logprobs > sampled_logprob).sum(dim=-1) + 1  # (R,)
    max_k = max(params[i].logprobs for i in rows)
    top_logprobs, top_ids = logprobs.topk(max_k, dim=-1)  # (R, max_k)
    for j, i in enumerate(rows):
        k = params[i].logprobs
        result[i] = Logprobs(
            token_ids=[int(sampled_rows[j, 0])] + top_ids[j, :k].tolist(),
            logprobs=[float(sampled_logprob[j, 0])] + top_logprobs[j, :k].tolist(),
            sampled_rank=int(ranks[j]))
    return result
