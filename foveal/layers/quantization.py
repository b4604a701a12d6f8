"""Online weight quantization of a loaded model (`--quantization int8`).

int8 is W8A8 with dynamic per-token activations: each linear layer's weight
becomes int8 with one float32 scale per output channel (symmetric, absmax /
127), and at run time each row of the input (one token) is quantized the same
way with its own scale. The product runs as an exact int8 x int8 -> int32 GEMM
(`torch._int_mm`, oneDNN's VNNI kernels on x86) and is rescaled by the two
scales. Because the arithmetic is exact and every token has its own scale, a
token's output does not depend on which other tokens share the step: chunked
prefill, prefix-cache hits and batching give the same numbers as a lone run.

What it covers: every `LinearBase` layer (the decoder's and the vision
tower's projections), on CPU. The LM head and the embeddings stay in the
compute dtype by default, as in the int8 checkpoints users run elsewhere (the
head's error reaches the logits directly); `quantize_lm_head` (--quantize-lm-head)
quantizes the head as well, as llama.cpp's q8_0 files do: with a large
vocabulary it is the biggest single weight each decode step reads. Measured (9,728 x 896 weights read
from memory, 2 threads, AMD EPYC with avx512_vnni; scripts/bench_linear_kernels.py):
3.4x fp32's oneDNN GEMM at one row, 2.6x at 256 rows, 2.0x at 1,024.

The kernel depends on the CPU (`int8_kernel`). The exact per-token GEMM needs int8
dot-product instructions (VNNI or AMX); without them `torch._int_mm` falls back to a
generic loop, measured on an AVX2-only AMD EPYC at 3.2x slower than fp32's oneDNN GEMM
at one row and 26x at 256 rows. There the layer runs FBGEMM's dynamic int8 linear instead
(AVX2 u8 x s8 kernels; 2.9x faster than fp32's oneDNN GEMM at one row, 2.0x at 256;
scripts/bench_linear_kernels.py, docs/benchmarks.md): its activations are
quantized per call, not per token, with one scale over the call's rows and 7-bit
values (`reduce_range`, which keeps AVX2's paired 16-bit sums from saturating). So on
such CPUs a token's output can depend on the other tokens of its step, as with batched
float kernels elsewhere; the exact kernel keeps batch invariance and can be asked for
with FOVEAL_INT8_KERNEL=exact.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch
from torch import nn

from foveal.config import CHECKPOINT_METHOD_NAMES
from foveal.errors import ConfigError
from foveal.kernels.native import native_kernels

QUANTIZATION_METHODS = ("int8",)
_INT8_MAX = 127.0


def check_quantization(method: str | None, device: str, checkpoint_method: str | None = None
                       ) -> str | None:
    """The online method to run ("int8") or None, or ConfigError.

    checkpoint_method: the checkpoint's own quantization ("gptq" / "awq" / "fp8", from
    config.json), if any. A --quantization that names it (vLLM's spelling, e.g. gptq,
    awq_marlin, compressed-tensors) is accepted and quantizes nothing more."""
    if method is None or method in ("", "none"):
        return None
    method = method.lower()
    if method in CHECKPOINT_METHOD_NAMES:
        named = CHECKPOINT_METHOD_NAMES[method]
        if checkpoint_method == named:
            return None
        found = (f"is a {checkpoint_method} checkpoint" if checkpoint_method else
                 "is not quantized (config.json has no quantization_config)")
        raise ConfigError(f"quantization={method!r} names a pre-quantized {named} checkpoint's "
                          f"method, but this checkpoint {found}; drop --quantization, or use "
                          f"--quantization int8 to quantize the weights at load time")
    if method not in QUANTIZATION_METHODS:
        raise ConfigError(f"quantization={method!r}; Foveal quantizes weights online with one of "
                          f"{list(QUANTIZATION_METHODS)} (--quantization), and loads GPTQ, AWQ and "
                          f"fp8 checkpoints as they are ({sorted(CHECKPOINT_METHOD_NAMES)} name them)")
    if device != "cpu":
        raise ConfigError(f"quantization={method!r} runs on CPU only (its int8 GEMM is oneDNN's); "
                          f"on {device} use --dtype bfloat16 without --quantization")
    return method


INT8_KERNELS = ("exact", "fbgemm")


@functools.cache
def int8_kernel() -> str:
    """"exact" (per-token W8A8 on `torch._int_mm`) where the CPU has int8 dot products,
    "fbgemm" (dynamic per-call activations) elsewhere; FOVEAL_INT8_KERNEL overrides."""
    from foveal.cpu_features import cpu_features

    choice = os.environ.get("FOVEAL_INT8_KERNEL", "auto").lower()
    if choice not in ("auto", *INT8_KERNELS):
        raise ConfigError(f"FOVEAL_INT8_KERNEL={choice!r}; expected auto, exact or fbgemm")
    if choice == "auto":
        fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
        choice = "exact" if cpu_features().int8_dot or not fbgemm else "fbgemm"
    return choice


def pack_fbgemm(qweight: torch.Tensor, scale: torch.Tensor):
    """FBGEMM's packed form of a per-channel symmetric int8 weight."""
    with warnings.catch_warnings():  # quantized tensors are deprecated; FBGEMM still takes them
        warnings.simplefilter("ignore")
        per_channel = torch._make_per_channel_quantized_tensor(
            qweight, scale.double(), torch.zeros(len(scale), dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(per_channel, None)


def shape_only(qweight: torch.Tensor) -> torch.Tensor:
    """A stand-in for an int8 weight that FBGEMM's packing holds: its shape and dtype on
    the meta device, no bytes (the packed copy alone is read, so the weight costs one
    byte per value, not two)."""
    return torch.empty(qweight.shape, dtype=qweight.dtype, device="meta")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per row): weight ~= q * scale[:, None]."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp_min(1e-12) / _INT8_MAX
    return torch.round(weight / scale[:, None]).to(torch.int8), scale


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None, fbgemm_weight=None, native: bool = False
                ) -> torch.Tensor:
    """x W^T + b with W = qweight * scale: x quantized per row on the fly, or, given
    the weight's FBGEMM packing, FBGEMM's dynamic int8 linear. native: see int8_matmul."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).float()
    if rows.shape[0] == 0:
        return x.new_empty(*shape[:-1], qweight.shape[0])
    if fbgemm_weight is not None:
        out = torch.ops.quantized.linear_dynamic(rows.contiguous(), fbgemm_weight, True)
    else:
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / _INT8_MAX
        quantized = torch.round(rows / row_scale).to(torch.int8)
        out = int8_matmul(quantized, qweight, native).float()
        out.mul_(row_scale).mul_(scale)
    if bias is not None:
        out.add_(bias.float())
    return out.to(x.dtype).reshape(*shape[:-1], qweight.shape[0])


# Steps of up to this many rows run the native int8 kernel: over `small`'s four
# projections, weights streamed from memory, it took 0.49-0.79x torch._int_mm's time at
# 1-10 rows, 0.85x (tcmalloc) and 0.99x (glibc malloc) at 12, 1.0-1.06x at 16 (python
# scripts/bench_linear_kernels.py --int8-rows; docs/benchmarks.md "Native decode kernels").
NATIVE_INT8_ROWS = 12


def int8_matmul(quantized: torch.Tensor, qweight: torch.Tensor, native: bool = False
                ) -> torch.Tensor:
    """(T, K) int8 times (N, K) int8, transposed: (T, N) int32, summed exactly (so any
    kernel gives the same numbers). Decode-sized inputs (T <= NATIVE_INT8_ROWS) on the
    native VNNI kernel (foveal/kernels; a compiled int8 decode step on it took 0.78x its
    time on `torch._int_mm`, docs/benchmarks.md "Native decode kernels"), others on
    `torch._int_mm` (oneDNN).

    native: the layer's mark (`native_gemv`, set when it was quantized): whether the
    native int8 kernel was built then."""
    if native and quantized.shape[0] <= NATIVE_INT8_ROWS:
        if torch.compiler.is_compiling():
            return torch.ops.foveal.decode_gemv_int8(quantized, qweight)
        return native_kernels().gemv_int8(quantized.contiguous(), qweight)
    return torch._int_mm(quantized, qweight.t())


@torch.library.custom_op("foveal::decode_gemv_int8", mutates_args=())
def _decode_gemv_int8_op(quantized: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """int8_matmul's native kernel as an op compiled decode steps call."""
    return native_kernels().gemv_int8(quantized.contiguous(), qweight)


@_decode_gemv_int8_op.register_fake
def _(quantized: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    return quantized.new_empty(quantized.shape[0], qweight.shape[0], dtype=torch.int32)


def quantize_weights(model: nn.Module, method: str | None, lm_head: bool = False) -> int:
    """Quantize every linear layer of `model` (and every MoE layer's experts) in
    place; returns how many. The dense weight is released: from then on
    forward() reads the int8 copy. Layers marked `keep_float` (MoE routers) stay.

    lm_head: the LM head too. It keeps its dense weight, which a tied embedding
    shares (and an untied one is small next to the decode-time saving)."""
    if method is None:
        return 0
    from foveal.layers.embed_head import ParallelLMHead
    from foveal.layers.linear import LinearBase

    from foveal.layers.moe import FusedExperts

    kernel = int8_kernel()
    native_int8 = kernel == "exact" and (kernels := native_kernels()) is not None and kernels.has_int8
    count = 0
    for module in model.modules():
        if isinstance(module, FusedExperts):
            module.quantize_int8(fbgemm=kernel == "fbgemm")
            count += 1
            continue
        if getattr(module, "keep_float", False):
            continue
        head = lm_head and isinstance(module, ParallelLMHead)
        if not (isinstance(module, LinearBase) or head) or module.weight.dim() != 2:
            continue
        if module.weight.numel() == 0:
            continue
        qweight, module.int8_scale = quantize_int8(module.weight)
        module.int8_fbgemm = pack_fbgemm(qweight, module.int8_scale) if kernel == "fbgemm" else None
        module.native_gemv = native_int8  # decode-sized steps on the native int8 GEMV
        module.int8_weight = shape_only(qweight) if module.int8_fbgemm is not None else qweight
        if not head:
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)
        count += 1
    return count
