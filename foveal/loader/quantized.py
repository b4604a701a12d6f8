"""Pre-quantized checkpoints (GPTQ, AWQ, fp8), dequantized to float at load time.

The packed tensors of each quantized linear layer are grouped by their prefix and
turned into one float `<prefix>.weight` of shape (out, in), so everything after
loading (tensor-parallel slices, prepacking, --quantization int8) sees a float
checkpoint. Other tensors (unquantized modules, biases, norms) pass through.

Layouts (int32 words hold 32 // bits values, lowest bits first):
  GPTQ  qweight (in / pack, out): packed along the input dim;
        qzeros (groups, out / pack): packed along the output dim; the v1 format
        ("gptq") stores each zero point minus one (modulo 2**bits), "gptq_v2" as is;
        scales (groups, out); g_idx (in,): each input channel's group (permuted
        under desc_act; i // group_size when absent); w = scale * (q - zero).
  AWQ   qweight (in, out / 8), qzeros (groups, out / 8): packed along the output
        dim, word position i holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i];
        scales (groups, out); input channel i is in group i // group_size.
  fp8   weight (out, in) float8_e4m3fn times weight_scale or weight_scale_inv
        (both multiply): one scale, one per output channel, or one per block.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from foveal.config import CheckpointQuantization
from foveal.errors import CheckpointError

_PACKED_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"),
                 "awq": ("qweight", "qzeros", "scales")}
_FP8_SCALES = ("weight_scale", "weight_scale_inv")
# AWQ word position -> column within its 8; this inverse puts columns back in order.
_AWQ_COLUMN_POSITIONS = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Each int32 word -> its 32 // bits unsigned values, lowest bits first,
    laid out consecutively along `dim` (0: rows, 1: columns)."""
    pack, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    rows, cols = packed.shape
    if dim == 0:
        values = (packed.unsqueeze(1) >> shifts.view(1, pack, 1)) & mask  # (rows, pack, cols)
        return values.reshape(rows * pack, cols)
    values = (packed.unsqueeze(2) >> shifts.view(1, 1, pack)) & mask  # (rows, cols, pack)
    return values.reshape(rows, cols * pack)


def _expect(prefix: str, part: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"{prefix}.{part} has shape {tuple(tensor.shape)}; the layer's other "
                              f"tensors need {shape}; the checkpoint is damaged or mislabelled")


def _group_index(prefix: str, parts: dict, in_features: int, groups: int,
                 group_size: int) -> torch.Tensor:
    """(in,) the group of each input channel."""
    if "g_idx" in parts:
        g_idx = parts["g_idx"].long()
        _expect(prefix, "g_idx", g_idx, (in_features,))
        if in_features and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise CheckpointError(f"{prefix}.g_idx names groups outside [0, {groups})")
        return g_idx
    if group_size == -1:
        return torch.zeros(in_features, dtype=torch.long)
    return torch.arange(in_features) // group_size


def _dequantize_int(prefix: str, parts: dict, spec: CheckpointQuantization) -> torch.Tensor:
    """GPTQ / AWQ parts -> (out, in) float32 (exact: fp16 scale x small int)."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if spec.method == "gptq":
        q = unpack_int32(qweight, spec.bits, dim=0)  # (in, out)
    else:
        q = unpack_int32(qweight, spec.bits, dim=1)  # (in, out), columns in word order
        order = torch.arange(q.shape[1]).view(-1, 8)[:, list(_AWQ_COLUMN_POSITIONS)].reshape(-1)
        q = q[:, order]
    in_features, out_features = q.shape
    groups = scales.shape[0]
    _expect(prefix, "scales", scales, (groups, out_features))
    expected_groups = 1 if spec.group_size == -1 else -(-in_features // spec.group_size)
    if "g_idx" not in parts and groups != expected_groups:
        raise CheckpointError(f"{prefix}.scales has {groups} groups; {in_features} input channels "
                              f"in groups of {spec.group_size} need {expected_groups}")
    pack = 32 // spec.bits
    _expect(prefix, "qzeros", qzeros, (groups, -(-out_features // pack)))
    # v1 stores a zero point of 0 as -1, i.e. all ones: adding the offset back wraps it
    zeros = (unpack_int32(qzeros, spec.bits, dim=1)[:, :out_features] + spec.zero_offset) & (
        (1 << spec.bits) - 1)
    if spec.method == "awq":
        zeros = zeros[:, order]
    g_idx = _group_index(prefix, parts, in_features, groups, spec.group_size)
    weight = scales[g_idx].float() * (q - zeros[g_idx]).float()  # (in, out)
    return weight.T.contiguous()


def _dequantize_fp8(prefix: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor,
                    block_size: tuple[int, ...]) -> torch.Tensor:
    """(out, in) float8 weight x its scales -> (out, in) float32."""
    out_features, in_features = weight.shape
    values, scale = weight.float(), scale.float()
    if scale.numel() == 1:
        return values * scale.reshape(())
    if tuple(scale.shape) in ((out_features,), (out_features, 1)) and not block_size:
        return values * scale.reshape(out_features, 1)
    if not block_size:
        raise CheckpointError(f"{prefix}.{scale_name} has shape {tuple(scale.shape)}; without "
                              f"weight_block_size it must hold 1 or {out_features} scales")
    rows, cols = block_size
    _expect(prefix, scale_name, scale, (-(-out_features // rows), -(-in_features // cols)))
    per_element = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return values * per_element[:out_features, :in_features]


def _dequantize(prefix: str, parts: dict, spec: CheckpointQuantization,
                dtype: torch.dtype) -> torch.Tensor:
    if spec.method == "fp8":
        scale_name = next((name for name in _FP8_SCALES if name in parts), None)
        if "weight" not in parts or scale_name is None:
            missing = "weight (float8)" if "weight" not in parts else " or ".join(_FP8_SCALES)
            raise CheckpointError(f"checkpoint lacks {prefix}.{missing}; an fp8 layer needs its "
                                  "float8 weight and its scale")
        weight = _dequantize_fp8(prefix, parts["weight"], scale_name, parts[scale_name],
                                 spec.block_size)
        return weight.to(dtype)
    required = ("qweight", "qzeros", "scales") + (("g_idx",) if spec.requires_g_idx else ())
    missing = [part for part in required if part not in parts]
    if missing:
        raise CheckpointError(f"checkpoint lacks {', '.join(f'{prefix}.{p}' for p in missing)}; "
                              f"a {spec.method.upper()} layer needs {', '.join(required)}")
    return _dequantize_int(prefix, parts, spec).to(dtype)


def _quantized_part(name: str, tensor: torch.Tensor, spec: CheckpointQuantization) -> str | None:
    """The part of a quantized layer `name` is ("qweight", "weight_scale", ...), or None."""
    part = name.rpartition(".")[2]
    if spec.method != "fp8":
        return part if part in _PACKED_PARTS[spec.method] else None
    if part == "weight":
        return part if tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1 else None
    return part if part in _FP8_SCALES or part == "input_scale" else None


def _is_complete(parts: dict, spec: CheckpointQuantization) -> bool:
    if spec.method == "fp8":
        return "weight" in parts and any(name in parts for name in _FP8_SCALES)
    return all(part in parts for part in _PACKED_PARTS[spec.method])


def dequantized_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], spec: CheckpointQuantization,
                           dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """A pre-quantized checkpoint's tensor stream as float tensors in `dtype`:
    each quantized layer's parts become `<prefix>.weight` once all have arrived
    (layers may span shards); fp8 activation scales (input_scale) are dropped,
    since activations stay float."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        part = _quantized_part(name, tensor, spec)
        if part is None:
            yield name, tensor
            continue
        prefix = name.rpartition(".")[0]
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if _is_complete(parts, spec):
            yield f"{prefix}.weight", _dequantize(prefix, pending.pop(prefix), spec, dtype)
    for prefix, parts in pending.items():
        if set(parts) != {"input_scale"}:
            yield f"{prefix}.weight", _dequantize(prefix, parts, spec, dtype)
