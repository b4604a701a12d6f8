"""A pre-LN ViT encoder covering CLIP and SigLIP vision towers.

API:
    config = ViTConfig.from_hf(vision_config_dict)      # CLIP or SigLIP, by model_type
    encoder = VisionEncoder(config)                     # module names = HF's `vision_model.*`
    feats = encoder(pixel_values, feature_layers=(-2,))  # (B, C, H, W) -> (B, N, hidden)

`feature_layers` index the encoder's hidden states as transformers does:
0 is the embeddings (after CLIP's pre_layrnorm), i the output of layer i,
negative values count from the end (-1: the last layer). Several layers are
concatenated along the feature dim. `post_layernorm=True` applies the final
norm to the result (SigLIP's / Gemma 3's last_hidden_state). Layers past the
deepest requested one are not run; their weights still load, so HF
checkpoints load unchanged (checkpoint prefix `...vision_model.` -> the
encoder's own prefix in a model's `weight_prefixes`).

Variants: CLIP (class token, bias-free patch conv, pre_layrnorm, quick_gelu)
and SigLIP (no class token, patch conv bias, gelu_pytorch_tanh). q/k/v load
into one `qkv_proj` through the model's packed_modules ("q_proj" -> ("qkv_proj",
"q"), ...); attention heads and the MLP are split over tensor-parallel ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from foveal.errors import ConfigError
from foveal.layers.activation import get_activation
from foveal.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear

# model_type -> (class token, pre-LN, patch bias, default act, default eps)
_VARIANTS = {
    "clip_vision_model": (True, True, False, "quick_gelu", 1e-5),
    "siglip_vision_model": (False, False, True, "gelu_pytorch_tanh", 1e-6),
}


@dataclass(frozen=True)
class ViTConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    class_token: bool = True  # CLIP: a learned CLS embedding leads the patch tokens
    pre_layernorm: bool = True  # CLIP's pre_layrnorm
    patch_bias: bool = False  # SigLIP's patch conv has a bias

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, vision: dict, model_type: str | None = None) -> "ViTConfig":
        """A CLIPVisionConfig / SiglipVisionConfig dict (defaults as transformers')."""
        model_type = model_type or vision.get("model_type", "clip_vision_model")
        if model_type not in _VARIANTS:
            raise ConfigError(f"vision model_type {model_type!r} is not a ViT Foveal builds; "
                              f"supported: {sorted(_VARIANTS)}")
        class_token, pre_ln, patch_bias, act, eps = _VARIANTS[model_type]
        siglip = model_type == "siglip_vision_model"
        return cls(
            hidden_size=vision.get("hidden_size", 768),
            intermediate_size=vision.get("intermediate_size", 3072),
            num_layers=vision.get("num_hidden_layers", 12),
            num_heads=vision.get("num_attention_heads", 12),
            image_size=vision.get("image_size", 224),
            patch_size=vision.get("patch_size", 16 if siglip else 32),
            num_channels=vision.get("num_channels", 3),
            layer_norm_eps=vision.get("layer_norm_eps", eps), hidden_act=vision.get("hidden_act", act),
            class_token=class_token, pre_layernorm=pre_ln, patch_bias=patch_bias)


class ViTEmbeddings(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.patch_size, self.class_token = config.patch_size, config.class_token
        patch_dim = config.num_channels * config.patch_size ** 2
        # HF's Conv2d with stride == kernel is a linear map of each flattened patch.
        self.patch_embedding = ReplicatedLinear(patch_dim, config.hidden_size, bias=config.patch_bias)
        self.patch_embedding.weight.hf_shape = (config.hidden_size, config.num_channels,
                                                config.patch_size, config.patch_size)
        if config.class_token:
            self.class_embedding = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        num_positions = config.num_patches + int(config.class_token)
        self.position_embedding = nn.Embedding(num_positions, config.hidden_size)
        self.position_embedding.weight.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        B, C, H, W = pixel_values.shape
        P = self.patch_size
        # A stride-P conv drops the pixels past the last whole patch (SigLIP-so400m reads
        # 384-pixel images as 27 x 27 patches of 14, i.e. 378 pixels): crop them the same way.
        pixel_values = pixel_values[:, :, :H // P * P, :W // P * P]
        patches = pixel_values.reshape(B, C, H // P, P, W // P, P).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(B, (H // P) * (W // P), C * P * P)  # (B, N, C*P*P)
        x = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))  # (B, N, hidden)
        if self.class_token:
            x = torch.cat([self.class_embedding.to(x.dtype).expand(B, 1, -1), x], dim=1)  # (B, 1+N, hidden)
        if x.shape[1] != self.position_embedding.num_embeddings:
            raise ConfigError(f"the vision tower got a {W}x{H} image, {x.shape[1]} positions; it was "
                              f"built for {self.position_embedding.num_embeddings}")
        return x + self.position_embedding.weight


class ViTAttention(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        head_dim = config.hidden_size // config.num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_heads,
                                          config.num_heads, bias=True)
        self.num_heads, self.head_dim = self.qkv_proj.num_heads, head_dim
        self.out_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        qkv = self.qkv_proj(x).view(B, N, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, h, N, D)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(B, N, -1))  # (B, N, hidden)


class ViTMLP(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.act = get_activation(config.hidden_act)
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ViTLayer(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ViTAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ViTMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ViTEncoderLayers(nn.Module):
    """Holds `layers` so names match HF's `encoder.layers.{i}`."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.layers = nn.ModuleList(ViTLayer(config) for _ in range(config.num_layers))


class VisionEncoder(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = config
        self.embeddings = ViTEmbeddings(config)
        if config.pre_layernorm:
            self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = ViTEncoderLayers(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def layer_index(self, layer: int) -> int:
        """A transformers hidden-states index (negative from the end) -> 0..num_layers."""
        index = layer + self.config.num_layers + 1 if layer < 0 else layer
        if not 0 <= index <= self.config.num_layers:
            raise ConfigError(f"vision feature layer {layer} is outside the tower's "
                              f"{self.config.num_layers} layers")
        return index

    def forward(self, pixel_values: torch.Tensor, feature_layers: tuple[int, ...] = (-1,),
                post_layernorm: bool = False) -> torch.Tensor:
        """(B, C, H, W) -> (B, N (+1 with a class token), hidden * len(feature_layers))."""
        wanted = [self.layer_index(layer) for layer in feature_layers]
        x = self.embeddings(pixel_values)
        if self.config.pre_layernorm:
            x = self.pre_layrnorm(x)
        states = {0: x}
        for index, layer in enumerate(self.encoder.layers[:max(wanted)], start=1):
            x = layer(x)
            states[index] = x
        out = torch.cat([states[i] for i in wanted], dim=-1)
        return self.post_layernorm(out) if post_layernorm else out


# Checkpoint module -> (fused module, shard id), to merge into a model's packed_modules.
VIT_PACKED_MODULES: dict[str, tuple[str, object]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
}
