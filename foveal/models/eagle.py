"""EAGLE draft heads (EAGLE-1 and EAGLE-3): one decoder layer that reads the
target's features and predicts the target's next tokens.

EAGLE-1: x = fc([embed(token), feature]) -> decoder layer (no input norm) ->
the predicted next feature, scored by the target's LM head.
EAGLE-3: feature = fc(three target layers' inputs, concatenated); x =
[input_norm(embed(token)), hidden_norm(feature)] (2H wide) -> attention ->
MLP -> final norm -> an LM head over the draft vocabulary, mapped to target
ids by d2t. Its pre-norm output is the feature of the next draft step.
The head shares the target's embeddings (and, without its own, LM head).
Attention is the engine's paged attention over the head's own KV cache
(kv_caches[0] of the forward context the proposer sets).
"""
from __future__ import annotations

import torch
from torch import nn

from foveal.layers.activation import ActAndMul
from foveal.layers.attention import Attention
from foveal.layers.embed_head import VocabParallelEmbedding
from foveal.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                  RowParallelLinear)
from foveal.layers.norm import RMSNorm
from foveal.layers.rotary import MRotaryEmbedding
from foveal.loader.eagle_config import EagleConfig


class EagleLayer(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        qkv_in = 2 * hidden if config.is_eagle3 else hidden
        self.qkv_proj = QKVParallelLinear(qkv_in, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.q_size = self.qkv_proj.num_heads * head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, hidden)
        self.rotary_emb = MRotaryEmbedding(head_dim, config.rope_theta, config.mrope_section)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                              head_dim ** -0.5, layer_idx=0)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [config.intermediate_size] * 2)
        self.act_fn = ActAndMul(config.hidden_act)
        self.down_proj = RowParallelLinear(config.intermediate_size, hidden)
        if config.is_eagle3:
            self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, qkv_in), residual (T, H) -> (mlp out, residual) (T, H) each."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        hidden, residual = self.post_attention_layernorm(self.o_proj(self.attn(q, k, v)), residual)
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden))), residual


class EagleHead(nn.Module):
    # Checkpoint prefix -> module prefix (vLLM / SGLang names, with or without "model.").
    weight_prefixes: tuple[tuple[str, str], ...] = tuple(
        (outer + source, target)
        for outer in ("model.", "")
        for source, target in (
            ("midlayer.self_attn.", "layer."), ("midlayer.mlp.", "layer."), ("midlayer.", "layer."),
            ("layers.0.self_attn.", "layer."), ("layers.0.mlp.", "layer."), ("layers.0.", "layer."),
            ("fc.", "fc."), ("norm.", "norm."), ("embed_tokens.", "embed_tokens."),
            ("lm_head.", "lm_head.")))
    packed_modules: dict[str, tuple[str, object]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # Checkpoint tensors the head does not keep (EAGLE-3's target->draft mask).
    ignored_weights = ("t2d",)

    def __init__(self, config: EagleConfig, own_embeddings: bool = False,
                 own_lm_head: bool = False, fc_bias: bool = False):
        """own_embeddings / own_lm_head: the checkpoint has its own (else the
        target's are used); fc_bias: an EAGLE-1 checkpoint with fc.bias."""
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        if config.is_eagle3:
            self.fc = ReplicatedLinear(3 * config.target_hidden_size, hidden)
            self.norm = RMSNorm(hidden, config.rms_norm_eps)
        else:
            self.fc = ReplicatedLinear(2 * hidden, hidden, bias=fc_bias)
        self.layer = EagleLayer(config)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, hidden)
                             if own_embeddings else None)
        self.lm_head = (ReplicatedLinear(hidden, config.draft_vocab_size)
                        if own_lm_head else None)
        # draft id -> target id offset (EAGLE-3 d2t); zeros: the vocabularies are the same
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))

    def combine(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's features for this head: EAGLE-3's three layers (T, 3*Ht) through
        fc -> (T, H); EAGLE-1's final hidden states pass unchanged."""
        return self.fc(target_features) if self.config.is_eagle3 else target_features

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds (T, H) of the token after each position, features (T, H) (combined)
        -> (output to score (T, H), feature for the next draft step (T, H))."""
        layer = self.layer
        if self.config.is_eagle3:
            normed = layer.hidden_norm(features)
            residual = normed if self.config.norm_before_residual else features
            x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        else:
            x = residual = self.fc(torch.cat([embeds, features], dim=-1))
        hidden, residual = layer(x, residual, positions)
        if self.config.is_eagle3:
            return self.norm(hidden, residual)
        out = hidden + residual
        return out, out

    def draft_token_ids(self, scored: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Greedy drafts: (N, H) -> (N,) target token ids."""
        head = self.lm_head if self.lm_head is not None else target_lm_head
        draft_ids = head(scored).argmax(dim=-1)  # (N,) in the draft vocabulary
        return draft_ids + self.d2t[draft_ids]
