"""Activation functions, as a registry keyed by HF `hidden_act` names."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from foveal.errors import ConfigError


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "quick_gelu": quick_gelu,
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ConfigError(f"hidden_act {name!r} is not supported; use one of "
                          f"{sorted(ACTIVATIONS)}") from None


class ActAndMul(nn.Module):
    """(N, 2*d) [gate | up] -> act(gate) * up, (N, d)."""

    def __init__(self, act_name: str = "silu"):
        super().__init__()
        self.act = get_activation(act_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up


class SiluAndMul(ActAndMul):
    def __init__(self):
        super().__init__("silu")
