"""The Qwen2 text decoder shared by Qwen2-VL and Qwen2.5-VL (GQA, qkv bias,
M-RoPE, SwiGLU MLP). Takes embeddings, so vision rows can be merged in."""
from __future__ import annotations

import torch
from torch import nn

from foveal.config import TextConfig
from foveal.layers.activation import ActAndMul
from foveal.layers.attention import Attention
from foveal.layers.embed_head import VocabParallelEmbedding
from foveal.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from foveal.layers.norm import RMSNorm
from foveal.layers.rotary import MRotaryEmbedding


class Qwen2Attention(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int):
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.q_size = self.qkv_proj.num_heads * head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size)
        self.rotary_emb = MRotaryEmbedding(head_dim, config.rope_theta, config.mrope_section,
                                           config.rope_scaling)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                              head_dim ** -0.5, layer_idx)

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        """rope: (cos, sin) (T, D) for this step, shared by every layer."""
        qkv = self.qkv_proj(hidden_states)  # (T, (H + 2*Hkv) * D)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb.rotate(q, k, *rope)
        return self.o_proj(self.attn(q, k, v))  # (T, hidden)


class Qwen2MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.act_fn = ActAndMul(hidden_act)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen2DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP (or a sparse MoE one, where the config says
    so: Qwen3-VL-MoE) with a fused residual; `attention` is the
    attention module's class (Qwen3 brings its q/k-norm one)."""

    def __init__(self, config: TextConfig, layer_idx: int, attention: type[nn.Module] = Qwen2Attention):
        super().__init__()
        self.self_attn = attention(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            from foveal.layers.moe import SparseMoeBlock

            self.mlp = SparseMoeBlock(config.hidden_size, config.moe_intermediate_size,
                                      config.num_experts, config.num_experts_per_tok,
                                      config.hidden_act)
        else:
            self.mlp = Qwen2MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, rope)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen2Model(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(T, hidden), positions (3, T) or (T,) -> (T, hidden).

        aux_layers: also return the inputs of these layers (the residual stream,
        what EAGLE-3 heads read), concatenated: (T, len(aux_layers) * hidden)."""
        hidden_states, residual = inputs_embeds, None
        rope = self.layers[0].self_attn.rotary_emb.cos_sin(positions)  # same for every layer
        aux = {}
        for index, layer in enumerate(self.layers):
            if index in aux_layers:
                aux[index] = hidden_states if residual is None else hidden_states + residual
            hidden_states, residual = layer(hidden_states, rope, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        if aux_layers:
            return hidden_states, torch.cat([aux[i] for i in aux_layers], dim=-1)
        return hidden_states
