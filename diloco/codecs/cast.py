"""Codecs that store every value on its own: raw FP32 and the 16-bit casts (docs/design.md
"Codecs").

Layouts (after the 5-byte header, see ``base``)::

    none:  n x float32 LE                 5 + 4n bytes
    bf16:  n x bfloat16 LE (upper half)   5 + 2n bytes
    fp16:  n x IEEE binary16 LE           5 + 2n bytes

Round-trip error bounds (round to nearest even, ``e = |decode(encode(x)) - x|``):

- ``none``: exact, bit for bit.
- ``bf16`` (8 significant bits): ``e <= 2**-8 * |x|`` for ``|x| >= 2**-126``;
  ``e <= 2**-134`` below (half of bfloat16's subnormal spacing).
- ``fp16`` (11 significant bits): ``e <= 2**-11 * |x|`` for ``|x| >= 2**-14``;
  ``e <= 2**-25`` below (half of binary16's subnormal spacing).

A value that would round to infinity in the target type (``|x| >= 65520`` for fp16, near
``2**128`` for bf16) is an error, never an Inf on the wire.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from diloco.codecs.base import Codec, CodecError, CodecId

__all__ = ["BF16Codec", "FP16Codec", "NoneCodec"]

_F32_LE = np.dtype("<f4")
_F16_LE = np.dtype("<f2")
_I16_LE = np.dtype("<i2")
_U16_LE = np.dtype("<u2")


def _check_finite(x: torch.Tensor) -> None:
    # min and max propagate NaN and Inf, and are far cheaper than isfinite().all().
    low, high = torch.aminmax(x)
    if not (math.isfinite(low) and math.isfinite(high)):
        raise CodecError("input holds NaN or Inf; non-finite values are never sent")


def _check_no_overflow(cast: torch.Tensor, name: str) -> None:
    low, high = torch.aminmax(cast)
    if math.isinf(low) or math.isinf(high):
        raise CodecError(f"input overflows {name}: a value rounds to infinity; use another codec")


class NoneCodec(Codec):
    """Raw little-endian FP32: the exact reference."""

    name = "none"
    codec_id = CodecId.NONE

    def _body_size(self, numel: int) -> int:
        return 4 * numel

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        _check_finite(x)
        return x.numpy().astype(_F32_LE, copy=False).tobytes()

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        values = np.frombuffer(body, dtype=_F32_LE, count=numel).astype(np.float32)
        return torch.from_numpy(values)


class BF16Codec(Codec):
    """bfloat16 cast: FP32's range, 8 significant bits."""

    name = "bf16"
    codec_id = CodecId.BF16

    def _body_size(self, numel: int) -> int:
        return 2 * numel

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        _check_finite(x)
        cast = x.to(torch.bfloat16)
        _check_no_overflow(cast, self.name)
        # numpy has no bfloat16: ship the raw 16 bits, which are FP32's upper half.
        return cast.view(torch.int16).numpy().astype(_I16_LE, copy=False).tobytes()

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        upper = np.frombuffer(body, dtype=_U16_LE, count=numel).astype(np.uint32)
        return torch.from_numpy((upper << 16).view(np.float32))


class FP16Codec(Codec):
    """IEEE binary16 cast: 11 significant bits, magnitudes up to 65504."""

    name = "fp16"
    codec_id = CodecId.FP16

    def _body_size(self, numel: int) -> int:
        return 2 * numel

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        _check_finite(x)
        cast = x.to(torch.float16)
        _check_no_overflow(cast, self.name)
        return cast.numpy().astype(_F16_LE, copy=False).tobytes()

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        values = np.frombuffer(body, dtype=_F16_LE, count=numel).astype(np.float32)
        return torch.from_numpy(values)
