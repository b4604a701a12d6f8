"""Sparse mixture-of-experts MLP (Qwen3-VL-MoE's layout).

A router (`gate`, a plain (E, hidden) weight) scores the experts per token;
the top k probabilities, renormalised to sum to 1, weigh those experts' SwiGLU
outputs. The experts' weights are fused per layer, as the checkpoints store
them: `experts.gate_up_proj` (E, 2 * I, hidden) and `experts.down_proj`
(E, hidden, I). Checkpoints written by the model's authors keep the other
orientation, (E, hidden, 2 * I) and (E, I, hidden); the weight loader reads
either (as transformers does) and takes this rank's slice.

Tensor parallelism splits every expert's intermediate size I over the ranks
(gate and up halves alike); each rank sums its partial outputs over its
experts and the ranks all-reduce, as a row-parallel layer does.

--quantization int8 stores each expert's weights as int8 per output channel
(the same kernels as the linear layers); the router stays float, so routing
decisions are the float model's.

Dispatch: tokens are sorted by expert and each expert that got any runs one
GEMM pair over its tokens, so a decode step of B tokens runs at most
B * top_k experts, and results are independent of which other tokens share
the step (a token's experts and weights depend on it alone). That loop sizes
its GEMMs from expert counts read on the host, which a CUDA graph cannot
replay; a decode graph's step (forward_context.static_shapes) instead gathers
each (token, slot) pair's expert weights and runs two batched GEMMs of fixed
shape: B * top_k weight copies, so the graph runner captures MoE decoders only
for batches of at most num_experts / top_k tokens (cuda_graphs.capture_sizes).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foveal.distributed import get_tp_rank, get_tp_size, tensor_parallel_all_reduce
from foveal.errors import CheckpointError
from foveal.forward_context import static_shapes
from foveal.layers.activation import get_activation
from foveal.layers.linear import ReplicatedLinear, _divide


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 hidden_act: str) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.local = _divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.local),
                                      requires_grad=False)
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.down_proj.weight_loader = self._load_down
        self.act = get_activation(hidden_act)
        # --quantization int8: per expert, (int8 gate_up, scale, FBGEMM packing or None)
        # and the same for down; the float weights are released
        self.int8: list[tuple[tuple, tuple]] | None = None

    def quantize_int8(self, fbgemm: bool) -> None:
        """Each expert's two weights as int8, one scale per output channel."""
        from foveal.layers.quantization import pack_fbgemm, quantize_int8, shape_only

        def one(weight: torch.Tensor) -> tuple:
            qweight, scale = quantize_int8(weight)
            if not fbgemm:
                return qweight, scale, None
            return shape_only(qweight), scale, pack_fbgemm(qweight, scale)

        self.int8 = [(one(self.gate_up_proj[e]), one(self.down_proj[e]))
                     for e in range(self.num_experts)]
        for param in (self.gate_up_proj, self.down_proj):
            param.data = torch.empty(0, dtype=param.dtype)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU MLP on its tokens x (n, hidden)."""
        if self.int8 is not None:
            from foveal.layers.quantization import int8_linear

            gate_up, down = self.int8[expert]
            gate, up = int8_linear(x, *gate_up[:2], None, gate_up[2]).chunk(2, dim=-1)
            return int8_linear(self.act(gate) * up, *down[:2], None, down[2])
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj[expert])

    def _oriented(self, loaded: torch.Tensor, rows: int, cols: int, name: str) -> torch.Tensor:
        """(E, rows, cols), transposing the (E, cols, rows) orientation."""
        shape = tuple(loaded.shape)
        if shape == (self.num_experts, rows, cols):
            return loaded
        if shape == (self.num_experts, cols, rows):
            return loaded.transpose(1, 2)
        raise CheckpointError(f"experts.{name} has shape {shape}; config.json gives "
                              f"({self.num_experts}, {rows}, {cols}) or its transpose")

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        full = self._oriented(loaded, 2 * self.intermediate_size, self.hidden_size, "gate_up_proj")
        start, size = self.tp_rank * self.local, self.local
        gate = full[:, start:start + size]
        up = full[:, self.intermediate_size + start:self.intermediate_size + start + size]
        param.data.copy_(torch.cat([gate, up], dim=1))

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        full = self._oriented(loaded, self.hidden_size, self.intermediate_size, "down_proj")
        start = self.tp_rank * self.local
        param.data.copy_(full[:, :, start:start + self.local])

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """x (T, hidden); experts / weights (T, k) -> this rank's partial (T, hidden)."""
        if self.int8 is None and static_shapes():
            return self._forward_static(x, experts, weights)
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (T*k,) assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // top_k
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = order[start:start + count]
            tokens = token_of[start:start + count]
            start += count
            y = self._expert(expert, x[tokens])
            out.index_add_(0, tokens, y * weights.reshape(-1)[rows, None].to(y.dtype))
        return out


    def _forward_static(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
                        ) -> torch.Tensor:
        """The dispatch without host reads: every (token, slot) pair's expert weights
        gathered, two batched GEMMs, the k outputs summed by their weights."""
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)  # (T*k,)
        rows = x.repeat_interleave(top_k, dim=0).unsqueeze(1)  # (T*k, 1, hidden)
        gate, up = torch.bmm(rows, self.gate_up_proj[flat].transpose(1, 2)).chunk(2, dim=-1)
        y = torch.bmm(self.act(gate) * up, self.down_proj[flat].transpose(1, 2))  # (T*k, 1, hidden)
        y = y.view(num_tokens, top_k, -1) * weights.unsqueeze(-1).to(y.dtype)
        return y.sum(1).to(x.dtype)  # (T, hidden)


class SparseMoeBlock(nn.Module):
    """Router + fused experts: (T, hidden) -> (T, hidden)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 hidden_act: str) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.gate.keep_float = True  # --quantization int8 leaves the router as stored
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (T, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (T, k)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = self.experts(x, experts, weights)
        if self.experts.tp_size > 1:
            out = tensor_parallel_all_reduce(out)
        return out
