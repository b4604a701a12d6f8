"""Static KV-cache scales shipped in a checkpoint (fp8 KV).

Quantized checkpoints (compressed-tensors, ModelOpt, ...) may store per-layer
`k_scale` / `v_scale` tensors (or one `kv_scale` for both) next to a decoder
layer's attention. With kv_cache_dtype=fp8_e4m3 they are used as the layer's
per-head quantization scales; with any other KV dtype they are read and
ignored. A scale has one value (per tensor) or one per KV head.
"""
from __future__ import annotations

import torch
from torch import nn

from foveal.distributed import get_tp_rank, get_tp_size
from foveal.errors import ConfigError
from foveal.layers.attention import Attention

SCALE_SUFFIXES = {"k_scale": (0,), "v_scale": (1,), "kv_scale": (0, 1)}


def is_kv_scale(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in SCALE_SUFFIXES


class KVScaleCollector:
    """Gathers scale tensors by attention layer while weights stream past."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.scales: dict[Attention, list[torch.Tensor | None]] = {}

    def add(self, module_path: str, suffix: str, tensor: torch.Tensor) -> None:
        layer = self._attention_at(module_path)
        entry = self.scales.setdefault(layer, [None, None])
        for index in SCALE_SUFFIXES[suffix]:
            entry[index] = tensor.detach().float().flatten()

    def apply(self, kv_cache_dtype: str, num_kv_heads: int) -> None:
        """Give every attention layer its (k, v) scales, this rank's heads, for fp8."""
        if kv_cache_dtype != "fp8_e4m3":
            return
        for layer, (k_scale, v_scale) in self.scales.items():
            if k_scale is None or v_scale is None:
                raise ConfigError(f"the checkpoint gives only one of k_scale / v_scale for an "
                                  f"attention layer (layer {layer.layer_idx}); give both or neither")
            layer.static_kv_scales = (self._rank_share(k_scale, num_kv_heads, layer),
                                      self._rank_share(v_scale, num_kv_heads, layer))

    def _attention_at(self, module_path: str) -> Attention:
        try:
            module = self.model.get_submodule(module_path)
        except AttributeError:
            module = None
        if isinstance(module, Attention):
            return module
        found = [m for m in module.children() if isinstance(m, Attention)] if module else []
        if len(found) != 1:
            raise ConfigError(f"checkpoint KV scale under {module_path!r}, which holds no "
                              "attention layer; check that config.json matches the weights")
        return found[0]

    @staticmethod
    def _rank_share(scale: torch.Tensor, num_kv_heads: int, layer: Attention) -> torch.Tensor:
        """(1,) or (num_kv_heads,) -> this rank's heads, (layer.num_kv_heads,)."""
        if scale.numel() not in (1, num_kv_heads):
            raise ConfigError(f"checkpoint KV scale of layer {layer.layer_idx} has "
                              f"{scale.numel()} values; expected 1 or one per KV head "
                              f"({num_kv_heads})")
        if scale.le(0).any() or not torch.isfinite(scale).all():
            raise ConfigError(f"checkpoint KV scale of layer {layer.layer_idx} holds a value "
                              "that is not a positive number")
        if scale.numel() == 1:
            return scale.expand(layer.num_kv_heads).clone()
        if layer.num_kv_heads == num_kv_heads:
            return scale
        per_rank = max(1, num_kv_heads // get_tp_size())
        first = (get_tp_rank() * per_rank) % num_kv_heads
        return scale[first:first + per_rank]
