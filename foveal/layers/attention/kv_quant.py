"""Quantized KV blocks: how keys and values are stored and read back.

Each codec stores one (token, head) vector of head_dim values with one scale
(float16) beside it, symmetric around zero:
    int8      round(x / s) in [-127, 127],  s = amax / 127
    int4      round(x / s) in [-7, 7],      s = amax / 7, two values per byte
              (element 2i in the low nibble, 2i+1 in the high one)
    fp8_e4m3  x / s as float8_e4m3fn,       s = amax / 448, or a static
              per-head scale from the checkpoint (k_scale / v_scale)
The scale is rounded to float16 before quantizing, so dequantizing with the
stored scale is exact to the codec's rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from foveal.errors import ConfigError

SCALE_DTYPE = torch.float16
_MIN_SCALE = 1e-6  # all-zero vectors: any positive scale decodes them to 0
_MAX_SCALE = 65504.0  # float16 max


@dataclass(frozen=True)
class KVCodec:
    name: str
    storage_dtype: torch.dtype
    values_per_element: int  # 2 for packed int4
    qmax: float  # largest magnitude a stored value holds
    # decode_raw(stored) * raw_factor * scale is the value (fp8 decodes through float16 bits)
    raw_factor: float = 1.0

    def stored_dim(self, head_dim: int) -> int:
        return head_dim // self.values_per_element

    def scales_for(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (...,) float16 scale of each vector."""
        amax = x.abs().amax(dim=-1).float()
        return (amax / self.qmax).clamp(_MIN_SCALE, _MAX_SCALE).to(SCALE_DTYPE)

    def quantize(self, x: torch.Tensor, scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., D) float -> (stored (..., D / values_per_element), scale (...,) float16).

        scale: a static scale broadcastable to x[..., 0] (fp8 from a
        checkpoint); by default one is computed per vector.
        """
        scale = self.scales_for(x) if scale is None else \
            scale.to(SCALE_DTYPE).expand(x.shape[:-1]).contiguous()
        scaled = x.float() / scale.float().unsqueeze(-1)
        return self._encode(scaled), scale

    def dequantize(self, stored: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """stored (..., D / values_per_element), scale (...,) -> (..., D) in dtype."""
        return self.decode_raw(stored, dtype) * (scale.to(dtype) * self.raw_factor).unsqueeze(-1)

    def decode_raw(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(..., D / values_per_element) -> (..., D) unscaled values in dtype: the
        value is raw * raw_factor * scale, so a caller can fold the scale into a
        smaller tensor (attention scores, probabilities)."""
        if self.name == "fp8_e4m3":
            # e4m3 bits moved into a float16 (sign, exponent, mantissa in place) read as
            # a float16 2^8 too small, subnormals included: one exact integer pass.
            bits = stored.view(torch.uint8).to(torch.int16)
            half = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
            return half.view(torch.float16).to(dtype)
        if self.values_per_element == 1:
            return stored.to(dtype)
        packed = stored.view(torch.int8)
        out = torch.empty((*stored.shape, 2), dtype=dtype, device=stored.device)
        out[..., 0] = (packed << 4) >> 4  # low nibble, sign-extended by the arithmetic shift
        out[..., 1] = packed >> 4  # high nibble
        return out.flatten(-2)

    def _encode(self, scaled: torch.Tensor) -> torch.Tensor:
        if self.name == "fp8_e4m3":
            return scaled.clamp(-self.qmax, self.qmax).to(self.storage_dtype)
        values = scaled.round().clamp(-self.qmax, self.qmax).to(torch.int8)
        if self.values_per_element == 1:
            return values
        nibbles = values.to(torch.uint8) & 0xF  # two's complement, low 4 bits
        return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


_CODECS: dict[str, KVCodec] = {
    "int8": KVCodec("int8", torch.int8, 1, 127.0),
    "int4": KVCodec("int4", torch.uint8, 2, 7.0),
}
if hasattr(torch, "float8_e4m3fn"):
    _CODECS["fp8_e4m3"] = KVCodec("fp8_e4m3", torch.float8_e4m3fn, 1, 448.0, raw_factor=256.0)

QUANTIZED_KV_DTYPES = ("int8", "int4", "fp8_e4m3")
_ALIASES = {"fp8": "fp8_e4m3"}


def canonical_kv_dtype(name: str) -> str:
    return _ALIASES.get(name, name)


def get_kv_codec(name: str) -> KVCodec:
    """The codec for a quantized kv_cache_dtype; ConfigError if this torch lacks it."""
    name = canonical_kv_dtype(name)
    if name not in _CODECS:
        if name in QUANTIZED_KV_DTYPES:
            raise ConfigError(f"kv_cache_dtype={name!r} needs torch.float8_e4m3fn, which torch "
                              f"{torch.__version__} lacks; use int8 (--kv-cache-dtype int8)")
        raise ConfigError(f"kv_cache_dtype={name!r} is not a quantized KV dtype; "
                          f"use one of {', '.join(QUANTIZED_KV_DTYPES)}")
    return _CODECS[name]


def codec_for_storage(dtype: torch.dtype) -> KVCodec | None:
    """The codec whose blocks are stored as `dtype`; None for float caches."""
    return next((c for c in _CODECS.values() if c.storage_dtype == dtype), None)
