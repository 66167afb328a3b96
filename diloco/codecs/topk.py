"""Top-k by magnitude: a value-dropping baseline for the compression ablation, not for runs.

The ``k = ceil(keep * n)`` values of largest magnitude are sent exactly, as a position and
an FP32 value each; the others decode as zero (no rescaling, so the result is biased toward
zero). Ties in magnitude are broken by ``torch.topk``; the positions go out ascending.

Layout (after the 5-byte header)::

    n again (uint32 LE) | k x uint32 LE positions, strictly ascending | k x float32 LE values
                                                               5 + 4 + 8k bytes

``n`` is repeated because ``k`` often does not change with ``n``, so the length alone could
not reveal an altered header count. About ``64 * keep`` bits per value; ``keep = 4.25 / 64``
(the default) matches e3m0. The decoder must be built with the encoder's ``keep``, or the
payload length does not match; positions out of range or not strictly ascending are
rejected. Unlike the other
codecs, encoding ``x[a:b]`` alone is NOT the slice of the encoded whole: which values are
the largest depends on the whole part.

Round-trip error: zero on kept values; ``-x`` on dropped ones, each of which is no larger in
magnitude than the smallest kept value.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from diloco.codecs.base import Codec, CodecError, CodecId
from diloco.codecs.drop import check_finite, check_keep

__all__ = ["DEFAULT_TOPK_KEEP", "TopKCodec"]

DEFAULT_TOPK_KEEP = 4.25 / 64
_COUNT_FORMAT = "<I"  # n again
_COUNT_BYTES = struct.calcsize(_COUNT_FORMAT)  # 4
_POSITIONS_OFFSET = _COUNT_BYTES
_U32_LE = np.dtype("<u4")
_F32_LE = np.dtype("<f4")


class TopKCodec(Codec):
    """The ``ceil(keep * n)`` largest magnitudes as (uint32 position, FP32 value) pairs."""

    name = "topk"
    codec_id = CodecId.TOPK

    def __init__(self, keep: float = DEFAULT_TOPK_KEEP) -> None:
        self.keep = check_keep(keep, self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(keep={self.keep!r})"

    def kept(self, numel: int) -> int:
        """``k``: values sent for a vector of ``numel`` values."""
        # The small tolerance keeps keep * n = 3.0000000001 from rounding up to 4.
        return min(numel, math.ceil(self.keep * numel - 1e-9))

    def _body_size(self, numel: int) -> int:
        return _COUNT_BYTES + 8 * self.kept(numel) if numel else 0

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        k = self.kept(x.numel())
        check_finite(x)
        positions = torch.topk(x.abs(), k, sorted=False).indices.sort().values
        return (
            struct.pack(_COUNT_FORMAT, x.numel())
            + positions.numpy().astype(_U32_LE).tobytes()
            + x[positions].numpy().astype(_F32_LE, copy=False).tobytes()
        )

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        (body_numel,) = struct.unpack_from(_COUNT_FORMAT, body, 0)
        if body_numel != numel:
            raise CodecError(f"topk body is for {body_numel} values, the header must be equal")
        k = self.kept(numel)
        positions = np.frombuffer(body, dtype=_U32_LE, count=k, offset=_POSITIONS_OFFSET)
        values = np.frombuffer(body, dtype=_F32_LE, count=k, offset=_POSITIONS_OFFSET + 4 * k)
        if k and (
            int(positions[-1]) >= numel or bool((np.diff(positions.astype(np.int64)) <= 0).any())
        ):
            raise CodecError(f"topk payload positions must be strictly ascending and below {numel}")
        out = torch.zeros(numel, dtype=torch.float32)
        out[torch.from_numpy(positions.astype(np.int64))] = torch.from_numpy(
            values.astype(np.float32)
        )
        return out
