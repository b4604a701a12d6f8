"""The Qwen3 text decoder of Qwen3-VL: Qwen2's layer with per-head q/k RMSNorm,
no qkv bias, interleaved M-RoPE, and DeepStack: extra visual features added
to the hidden states of the first decoder layers at the visual positions.

DeepStack rows travel as extra columns of the input embeddings: forward takes
(T, hidden * (1 + K)) where columns [hidden * (k+1), hidden * (k+2)) are
added after decoder layer k (zeros on text rows), or plain (T, hidden).
"""
from __future__ import annotations

import torch
from torch import nn

from foveal.config import TextConfig
from foveal.layers.attention import Attention
from foveal.layers.embed_head import VocabParallelEmbedding
from foveal.layers.linear import QKVParallelLinear, RowParallelLinear
from foveal.layers.norm import RMSNorm
from foveal.layers.rotary import MRotaryEmbedding
from foveal.models.qwen2 import Qwen2DecoderLayer


def interleaved_freq_axis(mrope_section: tuple[int, ...], num_freqs: int) -> torch.Tensor:
    """(D/2,) axis driving each frequency in Qwen3-VL's interleaved layout:
    t, h, w, t, h, w, ... while each axis has frequencies left (h and w get
    mrope_section[1] and [2]), then t for the rest."""
    axis = torch.zeros(num_freqs, dtype=torch.long)
    for dim, offset in ((1, 1), (2, 2)):
        axis[offset:mrope_section[dim] * 3:3] = dim
    return axis


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...]):
        super().__init__(head_dim, theta, mrope_section)
        if len(mrope_section) == 3:
            self.freq_axis.copy_(interleaved_freq_axis(mrope_section, head_dim // 2))


class Qwen3Attention(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int):
        super().__init__()
        head_dim = self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=False)
        self.q_size = self.qkv_proj.num_heads * head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * head_dim
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size)
        self.rotary_emb = InterleavedMRotaryEmbedding(head_dim, config.rope_theta, config.mrope_section)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                              head_dim ** -0.5, layer_idx)

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # (T, (H + 2*Hkv) * D)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, -1, self.head_dim)).view(num_tokens, -1)  # per head
        k = self.k_norm(k.reshape(num_tokens, -1, self.head_dim)).view(num_tokens, -1)
        q, k = self.rotary_emb.rotate(q, k, *rope)
        return self.o_proj(self.attn(q, k, v))  # (T, hidden)


class Qwen3Model(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config, i, Qwen3Attention)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(T, hidden * (1 + K)) or (T, hidden), positions (3, T) or (T,) -> (T, hidden).

        aux_layers: also return these layers' inputs (the residual stream EAGLE-3
        heads read), concatenated: (T, len(aux_layers) * hidden)."""
        hidden_states, *deepstack = inputs_embeds.split(self.hidden_size, dim=-1)  # K x (T, hidden)
        residual = None
        rope = self.layers[0].self_attn.rotary_emb.cos_sin(positions)  # same for every layer
        aux = {}
        for index, layer in enumerate(self.layers):
            if index in aux_layers:
                aux[index] = hidden_states if residual is None else hidden_states + residual
            hidden_states, residual = layer(hidden_states, rope, residual)
            if index < len(deepstack):  # the layer's output is hidden_states + residual
                hidden_states = hidden_states + deepstack[index]
        hidden_states, _ = self.norm(hidden_states, residual)
        if aux_layers:
            return hidden_states, torch.cat([aux[i] for i in aux_layers], dim=-1)
        return hidden_states
