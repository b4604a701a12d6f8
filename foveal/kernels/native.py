"""The decode GEMV kernels of decode_gemv.c, built for this machine's CPU at first use.

The source is compiled once with the system C compiler (`-O3 -march=native
-fopenmp`; Inductor needs the same compiler for `--compile-decode`) into
~/.cache/foveal/kernels (FOVEAL_CACHE moves it), named by a hash of the
source, the compiler and the CPU's model and flags, so a machine with another
CPU builds its own. Loaded with ctypes; its OpenMP threads are torch's (the
library links libgomp.so.1, which torch has already loaded).

`native_kernels()` is None where they cannot serve: not x86 with AVX2+FMA, no
compiler, a failed build (logged once), or FOVEAL_NATIVE_KERNELS=0. Callers then
keep their other paths. Each entry point checks shapes and dtypes and raises
ValueError on a mismatch; the C code trusts them.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from foveal.logger import init_logger

logger = init_logger(__name__)

SOURCE = Path(__file__).with_name("decode_gemv.c")
GROUP_ROWS = 4  # rows a row kernel holds in registers at once (GROUP_ROWS in decode_gemv.c)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def _cache_dir() -> Path:
    from foveal.entrypoints.demo import default_cache_dir

    return default_cache_dir() / "kernels"


def _compiler() -> str | None:
    for name in ("gcc", "cc", "g++", "c++"):
        if path := shutil.which(name):
            return path
    return None


def _cpu_identity() -> str:
    """The CPU model and flags: a library built with -march=native runs only on its CPU."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("model name", "flags"))]
        return "".join(lines[:2])
    except OSError:
        return platform.processor()


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + version.encode() + _cpu_identity().encode()
                            + " ".join(_FLAGS).encode()).hexdigest()[:20]
    target = _cache_dir() / f"decode_gemv-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    language = ["-x", "c"] if compiler.endswith("++") else []
    # build beside the target, then rename: concurrent builders never load half a file
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *_FLAGS, *language, str(SOURCE), "-lm", "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, target)
    return target


class NativeKernels:
    def __init__(self, library: ctypes.CDLL):
        self._lib = library
        self.isa = library.foveal_isa()  # vector width the build uses: 512, 256 or 0
        self.has_int8 = bool(library.foveal_has_int8())
        if library.foveal_group_rows() != GROUP_ROWS:
            raise RuntimeError(f"decode_gemv.c groups {library.foveal_group_rows()} rows, "
                               f"native.py {GROUP_ROWS}")
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for name in ("foveal_gemv_f32", "foveal_gemv_bf16"):
            getattr(library, name).argtypes = [ptr, i64, i64, ptr, i64, ptr]
            getattr(library, name).restype = None
        library.foveal_gemv_s8.argtypes = [ptr, i64, i64, ptr, i64, ptr]
        library.foveal_gemv_s8.restype = ctypes.c_int
        for name in ("foveal_decode_attention_f32", "foveal_decode_attention_bf16"):
            getattr(library, name).argtypes = [ptr] * 7 + [i64, i64, ptr] + [i64] * 4 + [
                ctypes.c_float, i64, ptr]
            getattr(library, name).restype = None

    def gemv(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (T, K) float32 times weight (N, K) float32 or bfloat16, transposed:
        (T, N) float32. Each weight row is read from memory once for all T rows."""
        self._check(x, weight, torch.float32, (torch.float32, torch.bfloat16))
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        kernel = self._lib.foveal_gemv_f32 if weight.dtype == torch.float32 else self._lib.foveal_gemv_bf16
        kernel(weight.data_ptr(), weight.shape[0], weight.shape[1], x.data_ptr(), x.shape[0],
               out.data_ptr())
        return out

    def gemv_int8(self, xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """xq (T, K) int8 times weight (N, K) int8, transposed: (T, N) int32, exact."""
        if not self.has_int8:
            raise ValueError("the int8 kernel needs AVX-512 VNNI, which this CPU lacks")
        self._check(xq, weight, torch.int8, (torch.int8,))
        out = torch.empty(xq.shape[0], weight.shape[0], dtype=torch.int32)
        status = self._lib.foveal_gemv_s8(weight.data_ptr(), weight.shape[0], weight.shape[1],
                                          xq.data_ptr(), xq.shape[0], out.data_ptr())
        if status:
            raise MemoryError("foveal_gemv_s8 could not allocate its input buffer")
        return out

    def decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         slots: torch.Tensor, slot_mapping: torch.Tensor,
                         block_tables: torch.Tensor, block_size: int, seq_lens: torch.Tensor,
                         scale: float, window: int | None) -> torch.Tensor:
        """A pure decode step's attention, one new token per request: writes k / v (B,
        Hkv, D) at slot_mapping (B,) of `slots` (2, num_slots, Hkv, D; the layer's cache),
        then attends q (B, H, D) over each request's seq_lens[b] positions, read through
        block_tables (B, max_blocks) int32. Returns (B, H, D). float32 or bfloat16, all
        one dtype; window: only the last `window` positions (sliding-window layers)."""
        dtype = q.dtype
        if dtype not in (torch.float32, torch.bfloat16) or any(
                t.dtype != dtype for t in (k, v, slots)):
            raise ValueError(f"decode attention on {q.dtype} / {k.dtype} / {slots.dtype}: "
                             f"float32 or bfloat16, one dtype")
        batch, heads, head_dim = q.shape
        kv_heads = k.shape[1]
        if (k.shape != (batch, kv_heads, head_dim) or v.shape != k.shape or heads % kv_heads
                or slots.shape[0] != 2 or slots.shape[2:] != (kv_heads, head_dim)
                or slot_mapping.shape != (batch,) or seq_lens.shape != (batch,)
                or block_tables.dim() != 2 or block_tables.shape[0] != batch):
            raise ValueError("decode attention: shapes do not match")
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        slot_mapping = slot_mapping.to(torch.int64).contiguous()
        block_tables = block_tables.to(torch.int32).contiguous()
        seq_lens = seq_lens.to(torch.int32).contiguous()
        if not slots.is_contiguous():
            raise ValueError("decode attention: the KV cache must be contiguous")
        out = torch.empty_like(q)
        kernel = (self._lib.foveal_decode_attention_f32 if dtype == torch.float32
                  else self._lib.foveal_decode_attention_bf16)
        kernel(q.data_ptr(), k.data_ptr(), v.data_ptr(), slots[0].data_ptr(), slots[1].data_ptr(),
               slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], block_size,
               seq_lens.data_ptr(), batch, heads, kv_heads, head_dim, scale, window or 0,
               out.data_ptr())
        return out

    @staticmethod
    def _check(x: torch.Tensor, weight: torch.Tensor, x_dtype: torch.dtype,
               weight_dtypes: tuple[torch.dtype, ...]) -> None:
        if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
        if x.shape[0] < 1:
            raise ValueError("the decode kernels need at least one row")
        if x.dtype != x_dtype or weight.dtype not in weight_dtypes:
            raise ValueError(f"x {x.dtype}, weight {weight.dtype}: not a decode kernel's dtypes")
        for tensor in (x, weight):
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError("the decode kernels take contiguous CPU tensors")


@functools.cache
def native_kernels() -> NativeKernels | None:
    """The built kernels, or None where they do not serve (see the module docstring)."""
    if os.environ.get("FOVEAL_NATIVE_KERNELS", "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    from foveal.cpu_features import cpu_features

    if "avx2" not in cpu_features().flags:
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    try:
        kernels = NativeKernels(ctypes.CDLL(str(_build(compiler))))
    except (OSError, RuntimeError) as error:
        logger.warning("decode GEMV kernels not built (%s); using the library GEMV", error)
        return None
    if kernels.isa == 0:
        return None
    logger.info("decode GEMV kernels: %d-bit vectors%s", kernels.isa,
                ", int8 VNNI" if kernels.has_int8 else "")
    return kernels
