"""Linear layers that own their tensor-parallel sharding.

Each parameter carries `weight_loader(param, loaded_weight, shard_id=None)`
that copies this rank's slice of a full (HF-shaped) checkpoint tensor. Models
never mention ranks; tp_size=1 is the same code path.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from foveal.distributed import get_tp_rank, get_tp_size, tensor_parallel_all_reduce
from foveal.errors import CheckpointError, ConfigError
from foveal.forward_context import generated_rows
from foveal.kernels.native import native_kernels
from foveal.layers.op_registry import module_by_key, register_module
from foveal.layers.quantization import int8_linear


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ConfigError(f"{what}={numerator} is not divisible by tensor_parallel_size="
                          f"{denominator}; pick a tensor_parallel_size that divides it")
    return numerator // denominator


def check_shape(param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise CheckpointError(f"weight {name or '?'} has shape {tuple(loaded.shape)}, the model "
                              f"expects {tuple(param.shape)}; the checkpoint does not match config.json")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor,
                          shard_id=None) -> None:
    loaded_weight = loaded_weight.reshape(param.shape) if hasattr(param, "hf_shape") else loaded_weight
    check_shape(param, loaded_weight)
    param.data.copy_(loaded_weight)


class LinearBase(nn.Module):
    """y = x W^T + b, with W of local shape (output_size, input_size).

    tp_dim: 0 shards the output dim, 1 the input dim, None replicates.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.input_size, self.output_size, self.tp_dim = input_size, output_size, tp_dim
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed_weight: torch.Tensor | None = None  # set by prepack_weights()
        self.int8_weight: torch.Tensor | None = None  # set by quantize_weights()
        self.int8_scale: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        # A row-parallel bias (1-D, tp_dim 1) is replicated, not sharded.
        if self.tp_dim is not None and param.dim() > self.tp_dim and self.tp_size > 1:
            size = param.shape[self.tp_dim]
            loaded_weight = loaded_weight.narrow(self.tp_dim, self.tp_rank * size, size)
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(x, self, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output dim split over ranks; output stays sharded (feeds a RowParallelLinear)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        local = _divide(output_size, get_tp_size(), "output_size")
        super().__init__(input_size, local, bias, tp_dim=0)


class RowParallelLinear(LinearBase):
    """Input dim split over ranks; partial outputs are summed (all-reduce)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        local = _divide(input_size, get_tp_size(), "input_size")
        super().__init__(local, output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = apply_linear(x, self, None)
        if self.tp_size > 1:  # a layer built replicated (single_rank_layers) sums nothing
            y = tensor_parallel_all_reduce(y)
        # Bias added once, after the sum, so ranks do not add it tp_size times.
        return y + self.bias if self.bias is not None else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate/up: shard ids 0, 1)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def local_shard(self, shard_id: int) -> tuple[int, int]:
        """(offset, size) of part `shard_id` along this rank's output rows."""
        return (sum(self.output_sizes[:shard_id]) // self.tp_size,
                self.output_sizes[shard_id] // self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            raise CheckpointError("a merged linear needs a shard id (0, 1, ...) for each part")
        offset, size = self.local_shard(shard_id)
        loaded_weight = loaded_weight.narrow(0, self.tp_rank * size, size)
        target = param.data.narrow(0, offset, size)
        check_shape(target, loaded_weight)
        target.copy_(loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; heads split over ranks (KV heads replicated when
    there are fewer KV heads than ranks). Shard ids "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            # Fewer KV heads than ranks: each KV head lives on kv_replicas ranks.
            self.kv_replicas = _divide(tp_size, num_kv_heads, "tensor_parallel_size")
            self.num_kv_heads = 1
        output_size = (num_heads + 2 * self.num_kv_heads * tp_size) * head_dim
        super().__init__(hidden_size, output_size, bias)

    def shard_range(self, shard_id: str) -> tuple[int, int, int]:
        """(offset in the local param, local size, offset in the full checkpoint tensor)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        kv_rank = self.tp_rank // self.kv_replicas
        ranges = {"q": (0, q_size, self.tp_rank * q_size),
                  "k": (q_size, kv_size, kv_rank * kv_size),
                  "v": (q_size + kv_size, kv_size, kv_rank * kv_size)}
        return ranges[shard_id]

    def local_shard(self, shard_id: str) -> tuple[int, int]:
        """(offset, size) of q, k or v along this rank's output rows."""
        offset, size, _ = self.shard_range(shard_id)
        return offset, size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id not in ("q", "k", "v"):
            raise CheckpointError(f"QKV linear got shard id {shard_id!r}; expected 'q', 'k' or 'v'")
        offset, size, source_offset = self.shard_range(shard_id)
        loaded_weight = loaded_weight.narrow(0, source_offset, size)
        target = param.data.narrow(0, offset, size)
        check_shape(target, loaded_weight)
        target.copy_(loaded_weight)


def apply_linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b with the layer's weight: its int8 copy (--quantization int8), the native
    tile kernel for an fp32 layer in a step of at most `native_rows` generated rows
    (decode, speculative verify), or oneDNN on the weight prepack_weights gave it. Inside
    torch.compile (a compiled decode step, at most a few rows): a dense weight is read by
    a loop Inductor generates and fuses with its neighbours; other weights through the
    `foveal::linear` op."""
    if torch.compiler.is_compiling():
        return _compiled_linear(x, layer, bias)
    return _eager_linear(x, layer, bias)


def _eager_linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    if getattr(layer, "int8_weight", None) is not None:
        return int8_linear(x, layer.int8_weight, layer.int8_scale, bias,
                           getattr(layer, "int8_fbgemm", None), getattr(layer, "native_gemv", False))
    if 0 < x.numel() <= getattr(layer, "native_rows", 0) * x.shape[-1] and generated_rows():
        out = native_kernels().gemv(x.reshape(-1, x.shape[-1]).contiguous(), layer.packed_weight)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out + bias if bias is not None else out
    if layer.packed_weight is not None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), layer.packed_weight, bias,
                                                  "none", [], "")
    return F.linear(x, layer.weight, bias)


@torch.library.custom_op("foveal::linear", mutates_args=())
def _linear_op(x: torch.Tensor, layer: int, with_bias: bool) -> torch.Tensor:
    """A layer's eager linear (int8 FBGEMM, oneDNN-blocked) as an op a compiled graph
    calls without tracing into."""
    module = module_by_key(layer)
    return _eager_linear(x.contiguous(), module, module.bias if with_bias else None)


@_linear_op.register_fake
def _(x: torch.Tensor, layer: int, with_bias: bool) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _out_features(module_by_key(layer)))


def _out_features(layer: nn.Module) -> int:
    if getattr(layer, "int8_weight", None) is not None:
        return layer.int8_weight.shape[0]
    return layer.weight.shape[0] if layer.weight.numel() else layer.output_size


def _compiled_linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """Under torch.compile: x (T, K), T <= 4. A one-row step on a dense fp32 weight is a
    reduction Inductor writes and fuses with its neighbours (small_batch_linear);
    2-4 rows on fp32 and any rows on bf16 run the native decode GEMV
    (`foveal::decode_gemv`, foveal/kernels: each weight row read once for all rows),
    where those kernels are built. int8 weights on the exact kernel are traced as they
    are (activation quantization and rescale fuse around the int8 product, the native
    VNNI kernel where the CPU has it). FBGEMM's packed int8 weights, and the rest where
    the native kernels are not built, go through `foveal::linear` (measurements in
    docs/benchmarks.md, "Compiled decode steps" and "Native decode kernels")."""
    native = getattr(layer, "native_gemv", False)  # register_compiled_linears, quantize_weights
    int8 = getattr(layer, "int8_weight", None) is not None
    if int8 and getattr(layer, "int8_fbgemm", None) is None:
        return int8_linear(x, layer.int8_weight, layer.int8_scale, bias, native=native)
    dense = not int8 and layer.weight.numel() > 0
    fp32 = layer.weight.dtype == torch.float32
    if dense and fp32 and x.shape[0] == 1:
        return small_batch_linear(x, layer.weight, bias)
    if dense and (fp32 or layer.weight.dtype == torch.bfloat16) and native:
        out = torch.ops.foveal.decode_gemv(x.float(), layer.weight)
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)
    if not hasattr(layer, "compile_key"):
        raise RuntimeError("a linear layer without a compile key inside torch.compile")
    return torch.ops.foveal.linear(x, layer.compile_key, bias is not None)


def compiled_reads_dense(dtype: torch.dtype) -> bool:
    """Whether compiled decode steps read a layer's dense weight of this dtype (the
    engine then keeps it beside the blocked copy): fp32 always, bf16 through the
    native kernels."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_kernels() is not None)


@torch.library.custom_op("foveal::decode_gemv", mutates_args=())
def _decode_gemv_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (T, K) float32 times a dense fp32 / bf16 weight (N, K), transposed: (T, N)
    float32, by the native decode kernel (compiled steps: 1-4 rows)."""
    return native_kernels().gemv(x.contiguous(), weight)


@_decode_gemv_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, K) W^T + b as a reduction over K with an (N, T) output, written for
    Inductor: under torch.compile each weight row is loaded once and used for all T
    rows, its products summed in fp32 (scripts/bench_linear_kernels.py --compiled times
    it). Eagerly it is slow. Compiled steps use it for one-row fp32 layers, and for
    2-4 rows where the native kernels are not built."""
    out = (x.float()[None, :, :] * weight.float()[:, None, :]).sum(-1)  # (N, T)
    if bias is not None:
        out = out + bias.float()[:, None]
    return out.t().contiguous().to(x.dtype)


def register_compiled_linears(model: nn.Module) -> int:
    """Give every linear layer of `model` a key for `foveal::linear`, and mark whether its
    compiled steps use the native decode kernels (where they are built; a mark per
    layer, not a global, so each engine's graphs keep the choice they were traced
    with); returns how many layers."""
    kernels = native_kernels()
    count = 0
    for module in model.modules():
        if hasattr(module, "packed_weight") and not hasattr(module, "compile_key"):
            module.compile_key = register_module(module)
            if getattr(module, "int8_weight", None) is None:  # int8 layers: marked when quantized
                module.native_gemv = kernels is not None
            count += 1
    return count


def packs_bf16() -> bool:
    """Whether bf16 layers get oneDNN-blocked weights here: the CPU has bf16 instructions
    (elsewhere the blocked GEMM is emulated, and slow) and oneDNN can build the layout
    (it also needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    from foveal.cpu_features import cpu_features

    return cpu_features().native_bf16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


LINEAR_LAYOUTS = ("packed", "dense")
# In steps of up to this many rows that are all generated tokens or drafts (decode and
# speculative verify steps), eager fp32 layers run the native tile kernel (foveal/kernels)
# on their dense weight; other steps oneDNN on the same weight. Over a decode step's
# weights it took 0.76-0.91x oneDNN's time at 2-32 rows and about 1x at 48-64
# (docs/benchmarks.md, "Native decode kernels"). Prompt tokens (prefill, mixed steps, the
# last prompt token after a full prefix-cache hit) and the vision tower stay on oneDNN,
# whose fp32 GEMM gives a row the same bits at any row count from 2 up: a partial
# prefix-cache hit or another chunking leaves a prompt's numbers as they were. The tile
# kernel's bits do not depend on the row count either, so a generated token gets the same
# bits at any batch size up to this one, with or without speculation (oneDNN's one-row
# path did not match its larger calls).
NATIVE_F32_ROWS = 32


def linear_layout() -> str:
    """FOVEAL_LINEAR_LAYOUT: "packed" (the default: oneDNN-blocked weights where
    prepack_weights gives them) or "dense" (F.linear on the dense weights everywhere).
    On an AMX Xeon, end-to-end pairs disagreed between runs (docs/benchmarks.md "Linear
    weight layout"), so the default stays the layout measured ~2x faster on an AMD EPYC."""
    choice = os.environ.get("FOVEAL_LINEAR_LAYOUT", "packed").lower()
    if choice not in LINEAR_LAYOUTS:
        raise ConfigError(f"FOVEAL_LINEAR_LAYOUT={choice!r}; expected packed or dense")
    return choice


def describe_linear_layout() -> str:
    """What prepack_weights gives CPU linear layers here, for the start-up log and
    `foveal env`."""
    if linear_layout() == "dense":
        return "dense (F.linear; FOVEAL_LINEAR_LAYOUT=dense)"
    fp32 = (f"fp32 dense, decode and verify steps of up to {NATIVE_F32_ROWS} rows on the native "
            "tile kernel"
            if native_kernels() is not None else "fp32 oneDNN-blocked")
    bf16 = "bf16 oneDNN-blocked" if packs_bf16() else "bf16 dense"
    return f"packed ({fp32}; {bf16})"


def prepack_weights(model: nn.Module, keep_dense: bool = False) -> int:
    """Give every float32 CPU linear layer (and the LM head) the weight oneDNN runs
    forward() on from then on; returns how many got one. Where the native kernels are
    built, that is the layer's dense weight itself, and eager decode and verify steps of up
    to NATIVE_F32_ROWS rows run the native tile kernel on it instead (`native_rows`);
    elsewhere a oneDNN-blocked copy replaces the dense weight. bfloat16 layers get a
    blocked copy on CPUs with bf16 instructions. Nothing is packed with
    FOVEAL_LINEAR_LAYOUT=dense.

    Why: on an AMD EPYC (avx512_bf16, no AMX), oneDNN's GEMM runs 1.5-2.5x faster than
    the dense `F.linear` path at every batch size (decode GEMVs included; see
    docs/benchmarks.md), on its blocked layout or (fp32, 0.9-1.1x) the dense one; in
    bf16, blocked runs 2-3.6x faster than fp32 where the CPU has bf16 dot products. A
    blocked copy releases the layer's dense weight, since only forward() reads it; the
    LM head always keeps its dense weight (a tied embedding shares it), and an fp32 head
    runs on it too. For inference only: weight loading and export need the dense layout.
    keep_dense: keep the dense weight beside a blocked copy (compiled decode steps read it).
    """
    if not torch.backends.mkldnn.is_available() or linear_layout() == "dense":
        return 0
    dtypes = (torch.float32, torch.bfloat16) if packs_bf16() else (torch.float32,)
    native = native_kernels() is not None
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "packed_weight") or weight is None or weight.dim() != 2:
            continue
        if weight.device.type != "cpu" or weight.dtype not in dtypes:
            continue
        if getattr(module, "int8_weight", None) is not None:  # forward() reads the int8 copy
            continue
        if weight.dtype == torch.float32 and (native or not isinstance(module, LinearBase)):
            # oneDNN runs fp32 on the dense layout as fast as on a blocked copy (0.9-1.1x
            # from 1 to 2,048 rows, docs/benchmarks.md "Linear weight layout"), so an fp32
            # layer keeps its dense weight where the native kernels take its decode rows,
            # and the LM head always does (a tied embedding shares it, the model reads
            # its dtype and device): no second copy.
            module.packed_weight = weight.detach()
            if native and isinstance(module, LinearBase):
                module.native_rows = NATIVE_F32_ROWS
            count += 1
            continue
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        if isinstance(module, LinearBase) and not (keep_dense and compiled_reads_dense(weight.dtype)):
            module.weight.data = torch.empty(0, dtype=weight.dtype)
        count += 1
    return count
