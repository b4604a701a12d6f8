"""Qwen3-VL: the Qwen3-VL vision tower (learned + 2-D positions, DeepStack)
and the Qwen3 decoder with interleaved M-RoPE. Weight names are Qwen2-VL's
layout (model.visual., model.language_model., lm_head.).

Embeddings of an item are (placeholder length, hidden * (1 + K)): the merged
visual token and its K DeepStack rows side by side, so the encoder cache,
chunked prefill (rows sliced by offset) and disaggregated encode carry
DeepStack with no extra state; the model runner widens text rows with zeros.

A video's placeholder range also holds its per-frame text: "<t seconds>"
timestamps and the vision start / end tokens around each temporal patch
(feature data "frame_text_ids", "tail_ids"). Those rows are token embeddings
(no DeepStack), and each frame is placed like an image of one temporal patch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foveal.config import ModelConfig
from foveal.distributed import get_tp_size, single_rank_layers
from foveal.distributed.encoder_data_parallel import encode_across_ranks
from foveal.errors import PlaceholderMismatchError
from foveal.layers.embed_head import ParallelLMHead
from foveal.models.positions import MRopePositions
from foveal.models.qwen2_vl import Qwen2VLForConditionalGeneration, _grid, _pixels, _vision_positions
from foveal.models.qwen3 import Qwen3Model
from foveal.models.qwen3_vision import Qwen3VisionTransformer
from foveal.multimodal.inputs import MMFeature


def frame_segments(feature: MMFeature, merge_size: int
                   ) -> tuple[list[tuple[list[int], tuple[int, int, int]]], list[int]]:
    """An item's range as [(text ids before a temporal patch, its (1, h, w) grid)]
    plus the text ids after the last one. An image is one patch, no text."""
    t, h, w = _grid(feature)
    texts = [list(ids) for ids in feature.data.get("frame_text_ids") or [()] * t]
    tail = list(feature.data.get("tail_ids") or ())
    if len(texts) != t:
        raise PlaceholderMismatchError(f"{feature.modality} grid {(t, h, w)} has {t} temporal patches "
                                       f"but {len(texts)} frame texts; re-run the processor")
    return [(text, (1, h, w)) for text in texts], tail


def range_length(feature: MMFeature, merge_size: int) -> int:
    segments, tail = frame_segments(feature, merge_size)
    return sum(len(text) + h * w // merge_size ** 2 for text, (_, h, w) in segments) + len(tail)


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        self.config = config
        text = config.text
        if config.mm_encoder_tp_mode == "data":  # whole on every rank; items split per step
            with single_rank_layers():
                self.visual = Qwen3VisionTransformer(config.vision)
        else:
            self.visual = Qwen3VisionTransformer(config.vision)
        self.language_model = Qwen3Model(text)
        tied = self.language_model.embed_tokens if text.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, tied_embedding=tied)

    @property
    def embedding_width(self) -> int:
        """Columns of an item's embeddings: hidden, then hidden per DeepStack layer."""
        return self.config.text.hidden_size * (1 + len(self.config.vision.deepstack_visual_indexes))

    def embed_multimodal(self, features: list[MMFeature]) -> list[torch.Tensor]:
        if not features:
            return []
        merge = self.config.vision.spatial_merge_size
        grids = [_grid(f) for f in features]
        sizes = [t * h * w // merge ** 2 for t, h, w in grids]  # visual rows per item
        for feature in features:
            if range_length(feature, merge) != feature.placeholder.length:
                raise PlaceholderMismatchError(
                    f"{feature.modality} grid {_grid(feature)} gives {range_length(feature, merge)} "
                    f"tokens but its placeholder holds {feature.placeholder.length}; re-run the processor")
        device = self.lm_head.weight.device

        def encode(indices: list[int]) -> list[torch.Tensor]:
            pixels = torch.cat([_pixels(features[i]) for i in indices]).to(device)  # (N, C*T*P*P)
            return list(self.visual(pixels, [grids[i] for i in indices])
                        .split([sizes[i] for i in indices]))

        if self.config.mm_encoder_tp_mode == "data" and get_tp_size() > 1:
            visual = encode_across_ranks(encode, sizes, self.embedding_width, device,
                                         self.lm_head.weight.dtype)
        else:
            visual = encode(list(range(len(features))))
        return [self._with_text_rows(f, rows) for f, rows in zip(features, visual)]

    def _with_text_rows(self, feature: MMFeature, visual: torch.Tensor) -> torch.Tensor:
        """(visual tokens, width) -> (placeholder length, width): each temporal
        patch's rows after the embeddings of the text before it."""
        segments, tail = frame_segments(feature, self.config.vision.spatial_merge_size)
        if len(segments) == 1 and not segments[0][0] and not tail:
            return visual
        frames = visual.chunk(len(segments))  # equal-size temporal patches
        pieces = []
        for (text, _), frame in zip(segments, frames):
            pieces += [self._text_rows(text, frame), frame]
        pieces.append(self._text_rows(tail, visual))
        return torch.cat(pieces)

    def _text_rows(self, token_ids: list[int], like: torch.Tensor) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.long, device=like.device)
        rows = self.embed_input_ids(ids).to(like.dtype)  # (n, hidden)
        return F.pad(rows, (0, like.shape[-1] - rows.shape[-1]))  # no DeepStack on text

    @classmethod
    def position_rule(cls, config: ModelConfig) -> MRopePositions:
        return MRopePositions(config, cls.get_mrope_positions)

    @staticmethod
    def get_mrope_positions(config: ModelConfig, token_ids: list[int],
                            mm_features: list[MMFeature]) -> tuple[torch.Tensor, int]:
        """Text advances all three axes by one; each temporal patch (an image,
        or one video frame pair) takes (start, row, col) ids and the text after
        it resumes at start + max(rows, cols). Video timing is in the text."""
        merge = config.vision.spatial_merge_size
        spans, cursor, next_pos = [], 0, 0

        def text(length: int) -> None:
            nonlocal next_pos
            spans.append(torch.arange(length).expand(3, -1) + next_pos)
            next_pos += length

        for feature in sorted(mm_features, key=lambda f: f.placeholder.offset):
            if range_length(feature, merge) != feature.placeholder.length:
                raise PlaceholderMismatchError(
                    f"{feature.modality} grid {_grid(feature)} gives {range_length(feature, merge)} "
                    f"tokens but its placeholder holds {feature.placeholder.length}; re-run the processor")
            text(feature.placeholder.offset - cursor)
            segments, tail = frame_segments(feature, merge)
            for frame_text, grid in segments:
                text(len(frame_text))
                spans.append(_vision_positions(grid, merge, next_pos, 1.0))
                next_pos += max(grid[1], grid[2]) // merge
            text(len(tail))
            cursor = feature.placeholder.end
        text(len(token_ids) - cursor)
        positions = torch.cat(spans, dim=1)  # (3, len(token_ids))
        delta = int(positions.max()) + 1 - len(token_ids) if positions.numel() else 0
        return positions, delta
