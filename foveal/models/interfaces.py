"""What the model runner needs from a model class.

Every architecture implements `SupportsMultiModal`. Attention layers read the
batch layout and KV caches from `foveal.forward_context`, so forward() takes
only embeddings and positions.
"""
from __future__ import annotations

from typing import Protocol

import torch

from foveal.config import ModelConfig
from foveal.models.positions import PositionRule
from foveal.multimodal.inputs import MMFeature


class SupportsMultiModal(Protocol):
    def __init__(self, config: ModelConfig) -> None: ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) int64 -> (T, hidden)."""

    def embed_multimodal(self, features: list[MMFeature]) -> list[torch.Tensor]:
        """Run the vision tower on a batch of items (any mix of images).

        Returns one (feature.placeholder.length, hidden) tensor per item, or
        wider: columns past hidden are per-layer additions (Qwen3-VL DeepStack)
        that the runner passes to forward() beside the embeddings (zeros on text).
        """

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(T, hidden), positions ((A, T) for a rule with A > 1 axes, else (T,))
        -> final hidden states (T, hidden)."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32."""

    # Weight-name tables that foveal.loader.weights reads to load a checkpoint;
    # a model never loads itself. Checkpoint prefix -> module prefix, first match wins.
    weight_prefixes: tuple[tuple[str, str], ...]
    # Checkpoint module name -> (fused module name, shard id passed to its weight_loader).
    packed_modules: dict[str, tuple[str, object]]

    @classmethod
    def position_rule(cls, config: ModelConfig) -> PositionRule:
        """How this family places tokens (foveal/models/positions.py)."""
