"""The EAGLE-3 head as a training graph, in the checkpoint layout vLLM and SGLang load.

Parameter names are the checkpoint's (fc, midlayer.*, norm, lm_head; d2t and
t2d buffers), so `state_dict()` is the exported head. The serving head
(foveal/models/eagle.py) computes the same function over the paged cache.

Training-time test (EAGLE-3): the head is unrolled `steps` times over a
sequence. Step 0 reads the target's features at every position; step j reads
its own step j-1 output one position on, as the serving chain does. A step-j
query at lineage b (the position its chain started from) attends to the
step-0 keys of positions <= b (the target's features, as in the serving
cache) and to its own lineage's keys of steps 1..j (the chain's entries).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foveal.layers.activation import ACTIVATIONS
from foveal.layers.rotary import MRotaryEmbedding, apply_rotary
from foveal.loader.eagle_config import EagleConfig


class _Attention(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, d)
        bias = config.attention_bias
        self.q_proj = nn.Linear(2 * hidden, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(2 * hidden, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(2 * hidden, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (N, 2H) -> q (N, Hq, D), k/v (N, Hkv, D), q and k rotated."""
        n = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(n, self.num_heads, -1), cos, sin)
        k = apply_rotary(self.k_proj(x).view(n, self.num_kv_heads, -1), cos, sin)
        return q, k, self.v_proj(x).view(n, self.num_kv_heads, -1)


class _MLP(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        hidden, ffn = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = _Attention(config)
        self.mlp = _MLP(config)
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)


class Eagle3Graph(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        if not config.is_eagle3:
            raise ValueError("the training graph is an EAGLE-3 head")
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.rotary = MRotaryEmbedding(config.head_dim, config.rope_theta, config.mrope_section)

    def _layer_input(self, embeds: torch.Tensor, features: torch.Tensor):
        layer = self.midlayer
        normed = layer.hidden_norm(features)
        residual = normed if self.config.norm_before_residual else features
        return torch.cat([layer.input_layernorm(embeds), normed], dim=-1), residual

    def _layer_output(self, attn: torch.Tensor, residual: torch.Tensor):
        """attention output (N, Hq*D) -> (scored, next feature) (N, H) each."""
        layer = self.midlayer
        residual = layer.self_attn.o_proj(attn) + residual
        residual = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.norm(residual), residual

    def unroll(self, aux: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
               steps: int) -> list[torch.Tensor]:
        """One sequence: aux (N, 3*Ht) target features at positions 0..N-1, embeds
        (N + steps - 1, H) of tokens 1..N+steps-1, positions (A, N + steps - 1)
        -> per step j, draft-vocab logits (N, Vd): row b predicts token b + j + 2.
        Rows whose inputs run past the sequence are computed on clamped inputs;
        the caller masks them."""
        n = aux.shape[0]
        attn = self.midlayer.self_attn
        group = attn.num_heads // attn.num_kv_heads
        scale = attn.head_dim ** -0.5
        features = self.fc(aux)
        keys, values, logits = None, None, []
        diag_keys, diag_values = [], []
        rows = torch.arange(n, device=aux.device)
        for step in range(steps):
            index = (rows + step).clamp(max=embeds.shape[0] - 1)
            cos, sin = self.rotary.cos_sin(positions[..., index])
            x, residual = self._layer_input(embeds[index], features)
            q, k, v = attn.qkv(x, cos, sin)  # (N, Hq|Hkv, D)
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (N, Hq, D)
            if step == 0:
                keys, values = k, v
            else:
                diag_keys.append(k)
                diag_values.append(v)
            scores = torch.einsum("nhd,mhd->hnm", q, keys) * scale  # (Hq, N, N)
            causal = torch.ones(n, n, dtype=torch.bool, device=aux.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            diag = [torch.einsum("nhd,nhd->hn", q, dk)[..., None] * scale for dk in diag_keys]
            weights = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)  # (Hq, N, N+j)
            out = torch.einsum("hnm,mhd->nhd", weights[..., :n], values)
            for i, dv in enumerate(diag_values):
                out = out + weights[..., n + i].transpose(0, 1)[..., None] * dv
            scored, features = self._layer_output(out.reshape(n, -1), residual)
            logits.append(self.lm_head(scored))
        return logits

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor, target_lm_head: torch.Tensor) -> None:
        """Draft vocabulary = token_ids (sorted, Vd): d2t, t2d, and lm_head rows from
        the target's LM head (Vd rows of (V, H)) when the hidden sizes agree."""
        token_ids = token_ids.sort().values
        self.d2t.copy_(token_ids - torch.arange(len(token_ids)))
        self.t2d.zero_()
        self.t2d[token_ids] = True
        if target_lm_head.shape[1] == self.lm_head.weight.shape[1]:
            self.lm_head.weight.copy_(target_lm_head[token_ids])


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked rows of -sum p log q; logits/target_probs (N, Vd), mask (N,)."""
    losses = -(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    return (losses * mask).sum() / mask.sum().clamp(min=1)


def save_head(graph: Eagle3Graph, folder, dtype: torch.dtype = torch.float32) -> None:
    """folder/config.json + model.safetensors in the EAGLE-3 checkpoint layout."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from foveal.loader.eagle_config import eagle3_config_dict

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: (tensor if name in ("d2t", "t2d") else tensor.to(dtype)).contiguous()
             for name, tensor in graph.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(eagle3_config_dict(graph.config), indent=2))
