"""LLaVA-1.5: CLIP ViT (a chosen hidden layer) -> 2-layer MLP projector -> Llama.

Architecture only; HF weight names map onto modules through the data tables
below (transformers >= 4.52 names `model.vision_tower.vision_model.*`,
`model.multi_modal_projector.*`, `model.language_model.*`, and the older
`vision_tower.*`, `multi_modal_projector.*`, `language_model.model.*`,
`language_model.lm_head.*`). LLaVA-NeXT / OneVision (llava_next.py) add anyres
packing of several views per image. Positions are plain 1-D RoPE.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from foveal.config import ModelConfig
from foveal.distributed import get_tp_size, single_rank_layers
from foveal.distributed.encoder_data_parallel import encode_across_ranks
from foveal.errors import PlaceholderMismatchError
from foveal.layers.activation import get_activation
from foveal.layers.embed_head import ParallelLMHead
from foveal.layers.linear import ColumnParallelLinear, RowParallelLinear
from foveal.models.llama import LlamaModel
from foveal.models.positions import TextPositions
from foveal.models.vit import VIT_PACKED_MODULES, ViTConfig, VisionEncoder
from foveal.multimodal.inputs import MMFeature


# Which data key holds an item's views (images: base view + tiles; videos: frames).
_PIXEL_KEYS = {"image": "pixel_values", "video": "pixel_values_videos"}


def vit_config(config: ModelConfig) -> ViTConfig:
    """The tower's ViTConfig from VisionConfig (variant "clip" / "siglip") + LlavaSettings."""
    vision, settings = config.vision, config.family_config
    clip = vision.variant == "clip"
    return ViTConfig(hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
                     num_layers=vision.depth, num_heads=vision.num_heads, image_size=settings.image_size,
                     patch_size=vision.patch_size, num_channels=vision.in_channels,
                     layer_norm_eps=settings.vision_layer_norm_eps, hidden_act=vision.hidden_act,
                     class_token=clip, pre_layernorm=clip, patch_bias=not clip)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, hidden_size: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = ColumnParallelLinear(in_features, hidden_size, bias=bias)
        self.act = get_activation(act)
        self.linear_2 = RowParallelLinear(hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    # Checkpoint prefix -> module prefix, first match wins.
    weight_prefixes: tuple[tuple[str, str], ...] = (
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),  # transformers 5 writes the tower unwrapped
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "language_model."),
        ("model.image_newline", "image_newline.embedding"),
        ("vision_tower.vision_model.", "vision_tower."),
        ("vision_tower.", "vision_tower."),
        ("multi_modal_projector.", "multi_modal_projector."),
        ("language_model.model.", "language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("image_newline", "image_newline.embedding"),
        ("lm_head.", "lm_head."),
    )
    packed_modules: dict[str, tuple[str, object]] = {
        **VIT_PACKED_MODULES,
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Module prefix -> prefix in exported (transformers-5) checkpoints.
    export_prefixes: tuple[tuple[str, str], ...] = (
        ("vision_tower.", "model.vision_tower.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("language_model.", "model.language_model."),
        ("image_newline.embedding", "model.image_newline"),
        ("lm_head.", "lm_head."),
    )

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.settings = settings = config.family_config
        text = config.text
        # "data": tower and projector whole on every rank, a step's items split over the ranks
        with single_rank_layers() if config.mm_encoder_tp_mode == "data" else contextlib.nullcontext():
            self.vision_tower = VisionEncoder(vit_config(config))
            self.multi_modal_projector = LlavaMultiModalProjector(
                config.vision.hidden_size * len(settings.feature_layers), text.hidden_size,
                settings.projector_act, settings.projector_bias)
        self.language_model = LlamaModel(text)
        tied = self.language_model.embed_tokens if text.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, tied_embedding=tied)

    def keep_vision_only(self) -> None:
        """For an encode worker: free the text decoder's layers."""
        self.language_model.layers = nn.ModuleList()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)  # (T, hidden)

    def project_views(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(V, C, S, S) views -> (V, rows, hidden): tower layers, CLS dropped ("default"), projector."""
        features = self.vision_tower(pixel_values, self.settings.feature_layers)  # (V, N(+1), D*L)
        if self.settings.select_strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def pack_item(self, feature: MMFeature, views: torch.Tensor) -> torch.Tensor:
        """One item's projected views (V, rows, hidden) -> its placeholder rows (LLaVA-1.5: one view)."""
        return views.flatten(0, 1)

    def pack_video(self, frames: torch.Tensor) -> torch.Tensor:
        """A video's projected frames (F, rows, hidden) -> its placeholder rows (OneVision only)."""
        raise PlaceholderMismatchError(f"{type(self).__name__} takes images only, got a video")

    def embed_multimodal(self, features: list[MMFeature]) -> list[torch.Tensor]:
        if not features:
            return []
        pixels = [torch.as_tensor(f.data[_PIXEL_KEYS[f.modality]]) for f in features]  # each (V, C, S, S)
        sizes = [f.placeholder.length for f in features]
        device = self.lm_head.weight.device

        def encode(indices: list[int]) -> list[torch.Tensor]:
            views = self.project_views(torch.cat([pixels[i] for i in indices]).to(device))
            per_item = views.split([pixels[i].shape[0] for i in indices])
            return [self._checked(features[i], self.pack_video(views) if features[i].modality == "video"
                                  else self.pack_item(features[i], views))
                    for i, views in zip(indices, per_item)]

        if self.config.mm_encoder_tp_mode == "data" and get_tp_size() > 1:
            return encode_across_ranks(encode, sizes, self.config.text.hidden_size, device,
                                       self.lm_head.weight.dtype)
        return encode(list(range(len(features))))

    @staticmethod
    def _checked(feature: MMFeature, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] != feature.placeholder.length:
            raise PlaceholderMismatchError(
                f"{feature.modality} gives {rows.shape[0]} visual tokens but its "
                f"placeholder holds {feature.placeholder.length}; re-run the processor")
        return rows

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                aux_layers: tuple[int, ...] = ()):
        """-> hidden states (T, hidden); with aux_layers, also those layers' inputs."""
        return self.language_model(inputs_embeds, positions.reshape(-1), aux_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()  # (N, vocab)

    @classmethod
    def position_rule(cls, config: ModelConfig) -> TextPositions:
        return TextPositions()
