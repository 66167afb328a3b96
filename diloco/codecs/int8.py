"""Blockwise absmax int8 (INTELLECT-1 style), docs/design.md "Codecs"

Layout (after the 5-byte header; ``nb = ceil(n / 64)`` blocks of 64 values)::

    scales: nb x float32 LE  | values: n x int8 (no padding)     5 + 4*nb + n bytes

Block ``i`` has ``scale_i = absmax_i / 127`` (0 for an all-zero block) and each value is
``q = round(x / scale_i)`` in ``[-127, 127]``; decode is ``q * scale_i``. The last block is
zero-padded for its absmax only, so a part cut at a multiple of 64 values (in particular of
256) encodes to exactly the corresponding scales and values of the whole.

Round-trip bound: ``|decode(encode(x)) - x| <= scale_i * (1/2 + 2**-15)`` per value of block
``i``: half a quantisation step, plus FP32 rounding of the division and the product (each at
most ``127 * 2**-24`` steps). It holds for normal scales (``absmax >= 127 * 2**-126``).
"""

from __future__ import annotations

import numpy as np
import torch

from diloco.codecs.base import Codec, CodecError, CodecId

__all__ = ["Int8Codec"]

BLOCK_SIZE = 64
QMAX = 127
_F32_LE = np.dtype("<f4")
# Body: scales (nb x float32 LE) | values (n x int8); offsets are functions of nb.
_SCALES_OFFSET = 0


def _values_offset(num_blocks: int) -> int:
    return _SCALES_OFFSET + 4 * num_blocks


def _num_blocks(numel: int) -> int:
    return -(-numel // BLOCK_SIZE)


class Int8Codec(Codec):
    """One FP32 absmax scale per 64 values, values rounded to nearest int8."""

    name = "int8"
    codec_id = CodecId.INT8
    block_size = BLOCK_SIZE

    def _body_size(self, numel: int) -> int:
        return _values_offset(_num_blocks(numel)) + numel

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        n, nb = x.numel(), _num_blocks(x.numel())
        padded = x if n == nb * BLOCK_SIZE else torch.nn.functional.pad(x, (0, nb * BLOCK_SIZE - n))
        blocks = padded.view(nb, BLOCK_SIZE)  # (nb, 64)
        absmax = blocks.abs().amax(dim=1)  # (nb,)
        if not bool(torch.isfinite(absmax).all()):
            raise CodecError("input holds NaN or Inf; non-finite values are never sent")
        scales = absmax / QMAX
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # zero block: 0/1
        q = (blocks / divisor[:, None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
        scale_bytes = scales.numpy().astype(_F32_LE, copy=False).tobytes()
        return scale_bytes + q.view(-1)[:n].numpy().tobytes()

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        nb = _num_blocks(numel)
        scales = torch.from_numpy(
            np.frombuffer(body, dtype=_F32_LE, count=nb, offset=_SCALES_OFFSET).astype(np.float32)
        )
        if not bool(torch.isfinite(scales).all()) or bool(torch.signbit(scales).any()):
            raise CodecError("int8 payload holds a non-finite or negative scale")
        q = np.frombuffer(body, dtype=np.int8, count=numel, offset=_values_offset(nb))
        out = torch.zeros(nb * BLOCK_SIZE, dtype=torch.float32)
        out[:numel] = torch.from_numpy(q.astype(np.float32))
        if bool((out[:numel] < -QMAX).any()):
            raise CodecError(f"int8 payload holds the value -128, outside [-{QMAX}, {QMAX}]")
        out.view(nb, BLOCK_SIZE).mul_(scales[:, None])
        return out if numel == out.numel() else out[:numel].clone()
