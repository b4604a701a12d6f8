"""What the model runner needs from a model class.

Every architecture implements `SupportsMultiModal`. Attention layers read the
batch layout and KV caches from `foveal.forward_context`, so forward() takes
only embeddings and positions.
"""
from __future__ import annotations

from typing import Iterable, Protocol

import torch

from foveal.config import ModelConfig
from foveal.multimodal.inputs import MMFeature


class SupportsMultiModal(Protocol):
    def __init__(self, config: ModelConfig) -> None: ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) int64 -> (T, hidden)."""

    def embed_multimodal(self, features: list[MMFeature]) -> list[torch.Tensor]:
        """Run the vision tower on a batch of items (any mix of images).

        Returns one (feature.placeholder.length, hidden) tensor per item.
        """

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(T, hidden), positions (3, T) M-RoPE ids -> final hidden states (T, hidden)."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of the parameters loaded."""

    @staticmethod
    def get_mrope_positions(config: ModelConfig, token_ids: list[int],
                            mm_features: list[MMFeature]) -> tuple[torch.Tensor, int]:
        """M-RoPE position ids (3, len(token_ids)) int64 for a prompt, and the
        delta such that a token at index i >= len(token_ids) has position i + delta
        on all three axes."""
