"""Position rules: the rotary position ids of a prompt, per model family.

The model runner is generic over them. A rule gives a prompt's position ids
(num_axes, len(token_ids)) and a delta: every token after the prompt (outputs,
drafts) sits at position index + delta on every axis. 1-D RoPE families use
`TextPositions`; Qwen2-VL's M-RoPE (t, h, w) uses `MRopePositions`. A rule
reads only a feature's plain data (grid, timing), never its pixels, so a
worker that never saw the media still places the tokens.
"""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from foveal.config import ModelConfig
from foveal.multimodal.inputs import MMFeature


class PositionRule(Protocol):
    num_axes: int  # 1 for RoPE, 3 for M-RoPE; the model's forward takes (T,) or (A, T)

    def prompt_positions(self, token_ids: list[int], mm_features: list[MMFeature]
                         ) -> tuple[np.ndarray, int]:
        """(num_axes, len(token_ids)) int64 position ids, and the delta."""


class TextPositions:
    """Plain RoPE: token i sits at position i."""

    num_axes = 1

    def prompt_positions(self, token_ids: list[int], mm_features: list[MMFeature]
                         ) -> tuple[np.ndarray, int]:
        return np.arange(len(token_ids), dtype=np.int64)[None, :], 0


class MRopePositions:
    """Multimodal RoPE over (t, h, w), computed by the model's own rule."""

    num_axes = 3

    def __init__(self, config: ModelConfig, rule: Callable) -> None:
        self.config = config
        self.rule = rule  # (config, token_ids, mm_features) -> ((3, N) tensor, delta)

    def prompt_positions(self, token_ids: list[int], mm_features: list[MMFeature]
                         ) -> tuple[np.ndarray, int]:
        positions, delta = self.rule(self.config, token_ids, mm_features)
        return positions.cpu().numpy().astype(np.int64), int(delta)
