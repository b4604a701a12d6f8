"""What this CPU computes natively, read at run time (machines differ: one
runs AVX2 only, another AVX-512 with bf16 dot products, another AMX tiles).

The engine reads it twice: `--dtype auto` runs a bfloat16 checkpoint in
bfloat16 only where the CPU has bf16 instructions (elsewhere bf16 matmuls run
emulated, ~8x slower than fp32), and `prepack_weights` gives bf16 layers
oneDNN's blocked layout only there. Measured on an AMD EPYC with avx512_bf16
and no AMX (scripts/bench_linear_kernels.py, 9728x896 weight, 2 threads):
bf16 blocked GEMM 3.6x faster than fp32 blocked at one row (decode), 2.1x at
256 rows (prefill).
"""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch

_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
          "amx_int8", "avx512_fp16", "amx_fp16")


@dataclass(frozen=True)
class CPUFeatures:
    model: str
    flags: frozenset[str]
    torch_capability: str  # the ISA torch's own kernels dispatch to, e.g. "AVX512"

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls in hardware: AVX-512 BF16 dot products or AMX tiles."""
        return bool(self.flags & {"avx512_bf16", "amx_bf16"})

    @property
    def int8_dot(self) -> bool:
        """int8 dot products in hardware (VNNI or AMX), which oneDNN's exact int8 GEMM
        needs to be fast; without them `torch._int_mm` runs a slow generic loop."""
        return bool(self.flags & {"avx512_vnni", "avx_vnni", "amx_int8"})

    @property
    def amx(self) -> bool:
        return "amx_bf16" in self.flags

    def describe(self) -> str:
        shown = [flag for flag in _FLAGS if flag in self.flags] or ["no AVX2"]
        return f"{self.model} ({', '.join(shown)}; torch kernels: {self.torch_capability})"


@functools.cache
def cpu_features() -> CPUFeatures:
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key == "flags":
                    flags.update(value.split())
                    break  # every core reports the same
    except OSError:  # not Linux: what torch dispatches to is all we know
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    if not flags and capability.startswith("AVX512"):
        flags.update({"avx2", "avx512f"})
    elif not flags and capability == "AVX2":
        flags.add("avx2")
    return CPUFeatures(model, frozenset(flags & set(_FLAGS)), capability)
