"""Gemma 3 (Gemma3ForConditionalGeneration): SigLIP tower + projector + Gemma 3 decoder.

Vision: each 896x896 image (the base image and each pan-and-scan crop) runs
through the SigLIP encoder (models/vit.py, post-LN output); the projector
average-pools its (image_size / patch)^2 patches to mm_tokens_per_image tokens,
RMS-normalizes them and maps them to the text width. An image's tokens attend
to each other both ways: its feature carries the runs (`BIDIRECTIONAL_KEY`),
the scheduler keeps a run in one step and attention widens each query's keys
to the run's end.

Decoder: embeddings scaled by sqrt(hidden); RMSNorm with (1 + weight); norms
before and after attention and MLP; q/k RMSNorm per head; GeGLU (tanh gelu);
attention scale query_pre_attn_scalar^-0.5; sliding-window layers (local rope
base) interleaved with full-attention layers (global base, linear scaling);
final logit softcapping when set. Text positions are plain 1-D RoPE.

Architecture only; HF weight names map onto modules through the tables below.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foveal.config import ModelConfig, TextConfig
from foveal.distributed import get_tp_size, single_rank_layers
from foveal.distributed.encoder_data_parallel import encode_across_ranks
from foveal.errors import PlaceholderMismatchError
from foveal.layers.attention import Attention
from foveal.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from foveal.layers.linear import QKVParallelLinear, RowParallelLinear
from foveal.layers.rotary import MRotaryEmbedding, apply_rotary
from foveal.models.gemma3_config import Gemma3Settings
from foveal.models.positions import TextPositions
from foveal.models.qwen2 import Qwen2MLP
from foveal.models.vit import VIT_PACKED_MODULES, ViTConfig, VisionEncoder
from foveal.multimodal.inputs import BIDIRECTIONAL_KEY, MMFeature


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), in float32 (Gemma's)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, text: TextConfig, settings: Gemma3Settings, layer_idx: int):
        super().__init__()
        self.head_dim = head_dim = text.head_dim
        self.qkv_proj = QKVParallelLinear(text.hidden_size, head_dim, text.num_attention_heads,
                                          text.num_key_value_heads, bias=text.attention_bias)
        self.q_size = self.qkv_proj.num_heads * head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(text.num_attention_heads * head_dim, text.hidden_size,
                                        bias=text.attention_bias)
        self.q_norm = GemmaRMSNorm(head_dim, text.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, text.rms_norm_eps)
        self.is_sliding = settings.sliding_layers[layer_idx]
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                              settings.query_pre_attn_scalar ** -0.5, layer_idx,
                              sliding_window=settings.sliding_window if self.is_sliding else None)

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        """rope: (cos, sin) (T, D) of this layer's kind (sliding or full)."""
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # (T, (H + 2*Hkv) * D)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(self.q_norm(q.view(num_tokens, -1, self.head_dim)), *rope)  # (T, H, D)
        k = apply_rotary(self.k_norm(k.view(num_tokens, -1, self.head_dim)), *rope)  # (T, Hkv, D)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v)
        return self.o_proj(out)  # (T, hidden)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, text: TextConfig, settings: Gemma3Settings, layer_idx: int):
        super().__init__()
        self.self_attn = Gemma3Attention(text, settings, layer_idx)
        self.mlp = Qwen2MLP(text.hidden_size, text.intermediate_size, text.hidden_act)
        eps = text.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(text.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(text.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(text.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(text.hidden_size, eps)

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden_states), rope)
        hidden_states = hidden_states + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mixed)


class Gemma3TextModel(nn.Module):
    def __init__(self, text: TextConfig, settings: Gemma3Settings):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(text.vocab_size, text.hidden_size)
        self.embed_scale = text.hidden_size ** 0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(text, settings, i)
                                    for i in range(text.num_hidden_layers))
        self.norm = GemmaRMSNorm(text.hidden_size, text.rms_norm_eps)
        self.sliding_layers = settings.sliding_layers
        self.rotary_global = MRotaryEmbedding(text.head_dim, text.rope_theta)
        self.rotary_global.inv_freq /= settings.global_rope_scaling  # linear position scaling
        self.rotary_local = MRotaryEmbedding(text.head_dim, settings.local_rope_theta)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)  # (T, hidden)
        # the scale rounds to the weights' dtype first, as in transformers
        return embeds * torch.tensor(self.embed_scale).to(embeds.dtype)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(T, hidden), positions (T,) -> (T, hidden); with aux_layers, also those
        layers' inputs concatenated (T, len(aux_layers) * hidden), for EAGLE-3 heads."""
        ropes = {False: self.rotary_global.cos_sin(positions),  # (T, D) each, shared by layers
                 True: self.rotary_local.cos_sin(positions)}
        hidden_states, aux = inputs_embeds, {}
        for index, layer in enumerate(self.layers):
            if index in aux_layers:
                aux[index] = hidden_states
            hidden_states = layer(hidden_states, ropes[self.sliding_layers[index]])
        hidden_states = self.norm(hidden_states)
        if aux_layers:
            return hidden_states, torch.cat([aux[i] for i in aux_layers], dim=-1)
        return hidden_states


class Gemma3Projector(nn.Module):
    """(B, P*P, vision hidden) patches -> (B, tokens, text hidden): average pool, norm, project."""

    def __init__(self, vision_hidden: int, text_hidden: int, eps: float, kernel: int):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision_hidden, text_hidden),
                                                       requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden, eps)
        self.kernel = kernel

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        batch, num_patches, width = patches.shape
        side = int(round(num_patches ** 0.5))
        grid = patches.transpose(1, 2).reshape(batch, width, side, side)  # (B, Dv, P, P)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)  # (B, tokens, Dv)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


def _vit_config(config: ModelConfig, settings: Gemma3Settings) -> ViTConfig:
    vision = config.vision
    return ViTConfig(hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
                     num_layers=vision.depth, num_heads=vision.num_heads,
                     image_size=settings.image_size, patch_size=vision.patch_size,
                     num_channels=vision.in_channels, layer_norm_eps=settings.vision_layer_norm_eps,
                     hidden_act=vision.hidden_act, class_token=False, pre_layernorm=False,
                     patch_bias=True)


class Gemma3ForConditionalGeneration(nn.Module):
    # Checkpoint prefix -> module prefix, first match wins: transformers >= 4.52
    # names (model.vision_tower., model.language_model.), the older ones, and the
    # SigLIP tower with or without its `vision_model.` level (transformers 5 drops it).
    weight_prefixes: tuple[tuple[str, str], ...] = (
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "language_model."),
        ("vision_tower.vision_model.", "vision_tower."),
        ("vision_tower.", "vision_tower."),
        ("multi_modal_projector.", "multi_modal_projector."),
        ("language_model.model.", "language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("lm_head.", "lm_head."),
    )
    packed_modules: dict[str, tuple[str, object]] = {
        **VIT_PACKED_MODULES,
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    export_prefixes: tuple[tuple[str, str], ...] = (
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("language_model.", "model.language_model."),
        ("lm_head.", "lm_head."),
    )

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.settings = settings = config.family_config
        text = config.text
        if config.mm_encoder_tp_mode == "data":  # whole on every rank; items split per step
            with single_rank_layers():
                self.vision_tower = VisionEncoder(_vit_config(config, settings))
        else:
            self.vision_tower = VisionEncoder(_vit_config(config, settings))
        self.multi_modal_projector = Gemma3Projector(
            config.vision.hidden_size, text.hidden_size, settings.vision_layer_norm_eps,
            config.vision.spatial_merge_size)
        self.language_model = Gemma3TextModel(text, settings)
        tied = self.language_model.embed_tokens if text.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, tied_embedding=tied)

    def keep_vision_only(self) -> None:
        """For an encode worker: free the decoder's layers (the embeddings stay:
        a pan-and-scan item's rows include the text between its crops)."""
        self.language_model.layers = nn.ModuleList()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed(input_ids)  # (T, hidden)

    def embed_multimodal(self, features: list[MMFeature]) -> list[torch.Tensor]:
        """One (placeholder.length, hidden) tensor per item: its images' pooled tokens at
        its bidirectional runs, the embedded text between them (pan-and-scan crops)."""
        if not features:
            return []
        tokens = self.settings.mm_tokens_per_image
        counts = [int(f.data["pixel_values"].shape[0]) for f in features]
        for feature, count in zip(features, counts):
            runs = feature.data[BIDIRECTIONAL_KEY]
            if [length for _, length in runs] != [tokens] * count:
                raise PlaceholderMismatchError(
                    f"image with {count} crops needs {count} runs of {tokens} tokens; its "
                    f"placeholder holds runs {list(runs)}; re-run the processor")
        device, dtype = self.lm_head.weight.device, self.lm_head.weight.dtype
        sizes = [f.placeholder.length for f in features]

        def encode(indices: list[int]) -> list[torch.Tensor]:
            pixels = torch.cat([torch.as_tensor(features[i].data["pixel_values"]) for i in indices])
            patches = self.vision_tower(pixels.to(device, dtype), post_layernorm=True)  # (N, P*P, Dv)
            soft = self.multi_modal_projector(patches)  # (N, tokens, hidden)
            per_item = soft.split([counts[i] for i in indices])
            return [self._item_rows(features[i], rows) for i, rows in zip(indices, per_item)]

        if self.config.mm_encoder_tp_mode == "data" and get_tp_size() > 1:
            return encode_across_ranks(encode, sizes, self.config.text.hidden_size, device, dtype)
        return encode(list(range(len(features))))

    def _item_rows(self, feature: MMFeature, images: torch.Tensor) -> torch.Tensor:
        """images (count, tokens, hidden) -> (placeholder.length, hidden)."""
        runs = feature.data[BIDIRECTIONAL_KEY]
        if len(runs) == 1:
            return images[0]
        token_ids = torch.tensor(feature.data["token_ids"], device=images.device)
        rows = self.embed_input_ids(token_ids)  # (L, hidden): the text between the crops
        for (offset, length), image in zip(runs, images):
            rows[offset:offset + length] = image
        return rows

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                aux_layers: tuple[int, ...] = ()):
        """-> hidden states (T, hidden); with aux_layers, also those layers' inputs."""
        return self.language_model(inputs_embeds, positions, aux_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states).float()  # (N, vocab)
        cap = self.settings.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    @classmethod
    def position_rule(cls, config: ModelConfig) -> TextPositions:
        return TextPositions()
