"""Idefics3 / SmolVLM: SigLIP tower -> pixel-shuffle connector -> Llama decoder.

Each tile (and the global view) is one image_size x image_size picture: the
SigLIP encoder (models/vit.py, post-LN output) gives (side/patch)^2 patches,
the connector's pixel shuffle folds scale^2 neighbouring patches into one
feature (width x scale^2) and a bias-free linear maps it to the text width.
An image's feature covers its whole expanded text (row/col markers, the
<fake_token_around_image> separators, its <image> runs): the rows are the
embedded marker tokens with each <image> run replaced by one view's features.
Positions are plain 1-D RoPE.

Architecture only; HF weight names (`model.vision_model.*`, `model.connector.*`,
`model.text_model.*`, `lm_head.*`, the same in every transformers version;
un-prefixed names load too) map onto modules through the tables below.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from foveal.config import ModelConfig
from foveal.distributed import get_tp_size, single_rank_layers
from foveal.distributed.encoder_data_parallel import encode_across_ranks
from foveal.errors import PlaceholderMismatchError
from foveal.layers.embed_head import ParallelLMHead
from foveal.layers.linear import ReplicatedLinear
from foveal.models.llama import LlamaModel
from foveal.models.positions import TextPositions
from foveal.models.vit import VIT_PACKED_MODULES, ViTConfig, VisionEncoder
from foveal.multimodal.inputs import MMFeature
from foveal.multimodal.processors.idefics3 import IMAGE_RUNS_KEY


def vit_config(config: ModelConfig) -> ViTConfig:
    vision, settings = config.vision, config.family_config
    return ViTConfig(hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
                     num_layers=vision.depth, num_heads=vision.num_heads, image_size=settings.image_size,
                     patch_size=vision.patch_size, num_channels=vision.in_channels,
                     layer_norm_eps=settings.vision_layer_norm_eps, hidden_act=vision.hidden_act,
                     class_token=False, pre_layernorm=False, patch_bias=True)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """(B, S*S, D) patches -> (B, S*S / scale^2, D * scale^2), transformers' order."""
    B, N, D = x.shape
    side = int(N ** 0.5)
    x = x.view(B, side, side // scale, D * scale)  # fold `scale` columns
    x = x.permute(0, 2, 1, 3).reshape(B, side // scale, side // scale, D * scale * scale)  # fold rows
    return x.permute(0, 2, 1, 3).reshape(B, N // scale ** 2, D * scale * scale)


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.proj = ReplicatedLinear(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Idefics3Connector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, scale: int):
        super().__init__()
        self.scale = scale
        self.modality_projection = ModalityProjection(vision_hidden * scale ** 2, text_hidden)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.modality_projection(pixel_shuffle(patches, self.scale))  # (B, tokens, hidden)


class Idefics3ForConditionalGeneration(nn.Module):
    # Checkpoint prefix -> module prefix, first match wins.
    weight_prefixes: tuple[tuple[str, str], ...] = (
        ("model.vision_model.", "vision_model."),
        ("model.connector.", "connector."),
        ("model.text_model.", "text_model."),
        ("vision_model.", "vision_model."),
        ("connector.", "connector."),
        ("text_model.", "text_model."),
        ("lm_head.", "lm_head."),
    )
    packed_modules: dict[str, tuple[str, object]] = {
        **VIT_PACKED_MODULES,
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    export_prefixes: tuple[tuple[str, str], ...] = (
        ("vision_model.", "model.vision_model."),
        ("connector.", "model.connector."),
        ("text_model.", "model.text_model."),
        ("lm_head.", "lm_head."),
    )

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.settings = settings = config.family_config
        text = config.text
        # "data": tower and connector whole on every rank, a step's items split over the ranks
        with single_rank_layers() if config.mm_encoder_tp_mode == "data" else contextlib.nullcontext():
            self.vision_model = VisionEncoder(vit_config(config))
        self.connector = Idefics3Connector(config.vision.hidden_size, text.hidden_size,
                                           settings.scale_factor)
        self.text_model = LlamaModel(text)
        tied = self.text_model.embed_tokens if text.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, tied_embedding=tied)

    def keep_vision_only(self) -> None:
        """For an encode worker: free the decoder's layers (the embeddings stay: an
        item's rows include its marker text)."""
        self.text_model.layers = nn.ModuleList()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text_model.embed_tokens(input_ids)  # (T, hidden)

    def embed_multimodal(self, features: list[MMFeature]) -> list[torch.Tensor]:
        """One (placeholder.length, hidden) tensor per image: its embedded marker text
        with each <image> run holding one view's connector output."""
        if not features:
            return []
        tokens = self.settings.image_seq_len(self.config.vision.patch_size)
        counts = [int(f.data["pixel_values"].shape[0]) for f in features]
        for feature, count in zip(features, counts):
            runs = feature.data[IMAGE_RUNS_KEY]
            if [length for _, length in runs] != [tokens] * count:
                raise PlaceholderMismatchError(
                    f"image with {count} views needs {count} runs of {tokens} <image> tokens; its "
                    f"placeholder holds runs {list(runs)}; re-run the processor")
        device, dtype = self.lm_head.weight.device, self.lm_head.weight.dtype
        sizes = [f.placeholder.length for f in features]

        def encode(indices: list[int]) -> list[torch.Tensor]:
            pixels = torch.cat([torch.as_tensor(features[i].data["pixel_values"]) for i in indices])
            patches = self.vision_model(pixels.to(device, dtype), post_layernorm=True)  # (V, P, Dv)
            views = self.connector(patches).split([counts[i] for i in indices])  # each (v, tokens, hidden)
            return [self._view_rows(features[i], rows) for i, rows in zip(indices, views)]

        if self.config.mm_encoder_tp_mode == "data" and get_tp_size() > 1:
            rows = encode_across_ranks(encode, sizes, self.config.text.hidden_size, device, dtype)
        else:
            rows = encode(list(range(len(features))))
        # the marker text is embedded after the encoder: on every rank for every item (the
        # vocab-parallel embedding is a collective)
        return [self._with_markers(feature, item_rows) for feature, item_rows in zip(features, rows)]

    @staticmethod
    def _view_rows(feature: MMFeature, views: torch.Tensor) -> torch.Tensor:
        """views (V, tokens, hidden) -> (placeholder.length, hidden), zeros at the markers."""
        rows = views.new_zeros(feature.placeholder.length, views.shape[-1])
        for (offset, length), view in zip(feature.data[IMAGE_RUNS_KEY], views):
            rows[offset:offset + length] = view
        return rows

    def _with_markers(self, feature: MMFeature, rows: torch.Tensor) -> torch.Tensor:
        """Fill the marker rows (text between the <image> runs) with their token embeddings."""
        token_ids = torch.tensor(feature.data["token_ids"], device=rows.device)
        text = self.embed_input_ids(token_ids).to(rows.dtype)  # (L, hidden)
        is_view = torch.zeros(len(token_ids), dtype=torch.bool, device=rows.device)
        for offset, length in feature.data[IMAGE_RUNS_KEY]:
            is_view[offset:offset + length] = True
        return torch.where(is_view[:, None], rows, text)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                aux_layers: tuple[int, ...] = ()):
        """-> hidden states (T, hidden); with aux_layers, also those layers' inputs."""
        return self.text_model(inputs_embeds, positions.reshape(-1), aux_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()  # (N, vocab)

    @classmethod
    def position_rule(cls, config: ModelConfig) -> TextPositions:
        return TextPositions()


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM: Idefics3's architecture and weight names."""
