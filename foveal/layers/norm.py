"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 whatever the activation dtype, like the reference.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x -> norm(x); or with a residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._normalize(x)
        summed = x + residual
        return self._normalize(summed), summed
