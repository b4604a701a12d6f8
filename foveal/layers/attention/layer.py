"""The decoder attention layer: paged KV cache, backend chosen by device."""
from __future__ import annotations

import torch
from torch import nn

from foveal.forward_context import get_forward_context
from foveal.layers.op_registry import module_by_key, register_module


@torch.library.custom_op("foveal::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """One attention layer as an op a compiled graph calls without tracing into: the
    layer reads its KV cache and the batch layout from the forward context, and
    writes the new K/V into the cache (a side effect the graph does not see; nothing
    else in the forward reads the cache)."""
    return module_by_key(layer).attend(q.contiguous(), k.contiguous(), v.contiguous())


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape)  # contiguous, as the backends return it


class Attention(nn.Module):
    """Causal attention of new tokens over their requests' cached context.

    Reads the batch layout (AttentionMetadata) and this layer's KV cache
    (kv_caches[layer_idx], laid out as kv_spec.py says) and its scales (for
    quantized caches) from the forward context. Without metadata the batch is one fresh sequence and
    nothing is cached (used for profiling and simple tests).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 layer_idx: int, sliding_window: int | None = None):
        """sliding_window: a query sees only the last `sliding_window` positions (itself
        included); older KV blocks are not read (with KV cache groups the scheduler
        frees them; foveal/engine/kv_groups.py)."""
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale, self.layer_idx = head_dim, scale, layer_idx
        self.sliding_window = sliding_window
        self._backends: dict[str, object] = {}
        # Per-head (k, v) scales a checkpoint gives for fp8 KV; None: computed per token.
        self.static_kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.key = register_module(self)  # for foveal::attention

    def _backend(self, device_type: str):
        if device_type not in self._backends:
            from foveal.layers.attention import get_attention_backend

            backend_cls = get_attention_backend(device_type)
            window = {"sliding_window": self.sliding_window} if self.sliding_window else {}
            self._backends[device_type] = backend_cls(
                self.num_heads, self.num_kv_heads, self.head_dim, self.scale, **window)
        return self._backends[device_type]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, H*D), k/v (T, Hkv*D) -> (T, H*D). Inside torch.compile, an opaque op
        (foveal/worker/compiled_decode.py)."""
        if torch.compiler.is_compiling():
            return torch.ops.foveal.attention(q, k, v, self.key)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        metadata = context.metadata_for(self.layer_idx)
        kv_cache = kv_scales = None
        if metadata is not None:
            kv_cache = context.kv_caches[self.layer_idx]
            kv_scales = context.kv_scales[self.layer_idx] if context.kv_scales else None
        return self._backend(q.device.type).forward(q, k, v, kv_cache, metadata, kv_scales,
                                                    self.static_kv_scales)
