"""Qwen2-VL: vision tower + Qwen2 decoder with M-RoPE.

Architecture only; HF weight names map onto modules through the data
tables below, read by foveal.loader.weights.
"""
from __future__ import annotations

import torch
from torch import nn

from foveal.config import ModelConfig
from foveal.distributed import get_tp_size, single_rank_layers
from foveal.distributed.encoder_data_parallel import encode_across_ranks
from foveal.errors import PlaceholderMismatchError
from foveal.layers.embed_head import ParallelLMHead
from foveal.models.positions import MRopePositions
from foveal.models.qwen2 import Qwen2Model
from foveal.models.qwen_vision import VisionTransformer
from foveal.multimodal.inputs import MMFeature


def _grid(feature: MMFeature) -> tuple[int, int, int]:
    t, h, w = (int(x) for x in torch.as_tensor(feature.data["grid_thw"]).flatten().tolist())
    return t, h, w


# Which data key holds an item's patches, per modality.
_PIXEL_KEYS = {"image": "pixel_values", "video": "pixel_values_videos"}


def _pixels(feature: MMFeature) -> torch.Tensor:
    return torch.as_tensor(feature.data[_PIXEL_KEYS[feature.modality]])  # (N, C*T*P*P)


def _time_interval(config: ModelConfig, feature: MMFeature) -> torch.Tensor | float:
    """Temporal position step per temporal patch: Qwen2.5-VL spaces a video's
    patches by seconds (second_per_grid_t * tokens_per_second, float32 as in
    transformers); images and Qwen2-VL videos step by one."""
    if feature.modality != "video" or not config.vision.tokens_per_second:
        return 1.0
    seconds = torch.tensor(float(feature.data["second_per_grid_t"]), dtype=torch.float32)
    return config.vision.tokens_per_second * seconds


def _vision_positions(grid: tuple[int, int, int], merge_size: int, start: int,
                      time_interval: torch.Tensor | float) -> torch.Tensor:
    """(3, t*h*w/m^2) t/h/w position ids of one item's visual tokens."""
    t, h, w = grid[0], grid[1] // merge_size, grid[2] // merge_size
    temporal = (torch.arange(t) * time_interval).long() + start
    rows, cols = torch.arange(h) + start, torch.arange(w) + start
    grids = torch.meshgrid(temporal, rows, cols, indexing="ij")
    return torch.stack(grids).reshape(3, -1)


class Qwen2VLForConditionalGeneration(nn.Module):
    # Checkpoint prefix -> module prefix, first match wins: transformers >= 4.52
    # names (model.visual., model.language_model.) before the older ones.
    weight_prefixes: tuple[tuple[str, str], ...] = (
        ("model.visual.", "visual."),
        ("model.language_model.", "language_model."),
        ("visual.", "visual."),
        ("model.", "language_model."),
        ("lm_head.", "lm_head."),
    )
    # Checkpoint module name -> (fused module name, shard id).
    packed_modules: dict[str, tuple[str, object]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Module prefix -> prefix in exported (transformers-5) checkpoints.
    export_prefixes: tuple[tuple[str, str], ...] = (
        ("visual.", "model.visual."),
        ("language_model.", "model.language_model."),
        ("lm_head.", "lm_head."),
    )

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        text = config.text
        if config.mm_encoder_tp_mode == "data":  # whole on every rank; items split per step
            with single_rank_layers():
                self.visual = VisionTransformer(config.vision)
        else:
            self.visual = VisionTransformer(config.vision)
        self.language_model = Qwen2Model(text)
        tied = self.language_model.embed_tokens if text.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, tied_embedding=tied)

    def keep_vision_only(self) -> None:
        """For an encode worker: free the text decoder's layers. The vision tower
        stays, and so do the token embeddings and LM head (they name the device
        and dtype the tower's outputs take)."""
        self.language_model.layers = nn.ModuleList()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)  # (T, hidden)

    def embed_multimodal(self, features: list[MMFeature]) -> list[torch.Tensor]:
        if not features:
            return []
        grids = [_grid(f) for f in features]
        merge = self.config.vision.spatial_merge_size
        sizes = [t * h * w // merge ** 2 for t, h, w in grids]
        for feature, size in zip(features, sizes):
            if size != feature.placeholder.length:
                raise PlaceholderMismatchError(
                    f"{feature.modality} grid {_grid(feature)} gives {size} visual tokens but its "
                    f"placeholder holds {feature.placeholder.length}; re-run the processor")
        device = self.lm_head.weight.device

        def encode(indices: list[int]) -> list[torch.Tensor]:
            pixels = torch.cat([_pixels(features[i]) for i in indices]).to(device)  # (N, C*T*P*P)
            return list(self.visual(pixels, [grids[i] for i in indices])
                        .split([sizes[i] for i in indices]))

        if self.config.mm_encoder_tp_mode == "data" and get_tp_size() > 1:
            return encode_across_ranks(encode, sizes, self.config.vision.out_hidden_size,
                                       device, self.lm_head.weight.dtype)
        return encode(list(range(len(features))))

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                aux_layers: tuple[int, ...] = ()):
        """-> hidden states (T, hidden); with aux_layers, also those layers' inputs."""
        return self.language_model(inputs_embeds, positions, aux_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()  # (N, vocab)

    @classmethod
    def position_rule(cls, config: ModelConfig) -> MRopePositions:
        return MRopePositions(config, cls.get_mrope_positions)

    @staticmethod
    def get_mrope_positions(config: ModelConfig, token_ids: list[int],
                            mm_features: list[MMFeature]) -> tuple[torch.Tensor, int]:
        """Text tokens advance all three axes by one; an item's visual tokens
        take (t, row, col) ids from the position it starts at, and the text
        after it resumes at start + max(rows, cols)."""
        merge = config.vision.spatial_merge_size
        spans, cursor, next_pos = [], 0, 0
        for feature in sorted(mm_features, key=lambda f: f.placeholder.offset):
            text_len = feature.placeholder.offset - cursor
            spans.append(torch.arange(text_len).expand(3, -1) + next_pos)
            next_pos += text_len
            grid = _grid(feature)
            vision = _vision_positions(grid, merge, next_pos, _time_interval(config, feature))
            if vision.shape[1] != feature.placeholder.length:
                raise PlaceholderMismatchError(
                    f"{feature.modality} grid {grid} gives {vision.shape[1]} visual tokens but its "
                    f"placeholder holds {feature.placeholder.length}; re-run the processor")
            spans.append(vision)
            next_pos += max(grid[1], grid[2]) // merge
            cursor = feature.placeholder.end
        spans.append(torch.arange(len(token_ids) - cursor).expand(3, -1) + next_pos)
        positions = torch.cat(spans, dim=1)  # (3, len(token_ids))
        delta = int(positions.max()) + 1 - len(token_ids) if positions.numel() else 0
        return positions, delta
