"""Random value dropping with rescaling (DARE-like, Yu et al. 2024): a baseline, not for runs.

Kept for the compression ablation (the Streaming DiLoCo paper compares 4-bit floats against
dropping values at the same bit budget). Exactly ``k = max(1, round(keep * n))`` values,
chosen uniformly at random without replacement, are sent as FP32 already multiplied by
``n / k``; the others decode as zero. Every value is kept with probability ``k / n`` over
the seed, so ``E[decode(encode(x))] = x``. The positions are never sent: they are redrawn on
decode from the 64-bit seed in the payload (``torch.randperm`` on a CPU generator). The seed
comes from ``generator`` when one is given, else from a hash of the input, so that encoding
stays a pure function (and independent inputs get independent masks).

Layout (after the 5-byte header)::

    seed (uint64 LE) | n again (uint32 LE) | k x float32 LE, in ascending position order
                                                               5 + 12 + 4k bytes

``n`` is repeated because ``k`` often does not change with ``n``, so the length alone could
not reveal an altered header count. About ``32 * keep`` bits per value; ``keep = 4.25 / 32``
(the default) matches e3m0. The decoder must be built with the encoder's ``keep``, or the
payload length does not match. Unlike the other codecs, encoding ``x[a:b]`` alone is NOT the
slice of the encoded whole, even at multiples of 256: the mask depends on the part's length
and seed.

Round-trip error: kept values carry ``x * (n / k - 1)`` (rounded FP32 product), dropped ones
``-x``; no bound tighter than ``|err| <= |x| * max(1, n / k - 1)`` holds value by value.
"""

from __future__ import annotations

import hashlib
import math
import struct

import numpy as np
import torch

from diloco.codecs.base import Codec, CodecError, CodecId

__all__ = ["DEFAULT_DROP_KEEP", "DropCodec", "check_finite", "check_keep"]

DEFAULT_DROP_KEEP = 4.25 / 32
_PREFIX_FORMAT = "<QI"  # seed, n
_PREFIX_BYTES = struct.calcsize(_PREFIX_FORMAT)  # 12
_VALUES_OFFSET = _PREFIX_BYTES
_F32_LE = np.dtype("<f4")
_SEED_LIMIT = 2**63 - 1


def check_keep(keep: float, name: str) -> float:
    """Return ``keep`` as a float in (0, 1], or raise CodecError naming the codec."""
    keep = float(keep)
    if not 0 < keep <= 1:
        raise CodecError(f"{name} keep fraction must be in (0, 1], got {keep}")
    return keep


def check_finite(x: torch.Tensor) -> None:
    """Raise CodecError if ``x`` holds NaN or Inf (min and max propagate both)."""
    low, high = torch.aminmax(x)
    if not (math.isfinite(float(low)) and math.isfinite(float(high))):
        raise CodecError("input holds NaN or Inf; non-finite values are never sent")


def _positions(seed: int, numel: int, k: int) -> torch.Tensor:
    """The ``k`` kept positions, ascending, drawn from ``seed`` alone."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(numel, generator=generator)[:k].sort().values


class DropCodec(Codec):
    """FP32 values at ``k`` random positions (rescaled by ``n / k``) plus the mask's seed."""

    name = "drop"
    codec_id = CodecId.DROP

    def __init__(self, keep: float = DEFAULT_DROP_KEEP) -> None:
        self.keep = check_keep(keep, self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(keep={self.keep!r})"

    def kept(self, numel: int) -> int:
        """``k``: values sent for a vector of ``numel`` values."""
        return max(1, round(self.keep * numel)) if numel else 0

    def _body_size(self, numel: int) -> int:
        return _PREFIX_BYTES + 4 * self.kept(numel) if numel else 0

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        n, k = x.numel(), self.kept(x.numel())
        check_finite(x)
        if generator is None:
            digest = hashlib.blake2b(x.numpy().tobytes(), digest_size=8).digest()
            seed = int.from_bytes(digest, "little") & _SEED_LIMIT
        else:
            seed = int(torch.randint(0, _SEED_LIMIT, (1,), generator=generator))
        values = x[_positions(seed, n, k)] * (n / k)
        low, high = torch.aminmax(values)
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            raise CodecError(f"input overflows FP32 when rescaled by n / k = {n / k:.3g}")
        prefix = struct.pack(_PREFIX_FORMAT, seed, n)
        return prefix + values.numpy().astype(_F32_LE, copy=False).tobytes()

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        seed, body_numel = struct.unpack_from(_PREFIX_FORMAT, body, 0)
        if body_numel != numel:
            raise CodecError(f"drop body is for {body_numel} values, the header must be equal")
        k = self.kept(numel)
        if seed > _SEED_LIMIT:
            raise CodecError(f"drop payload seed {seed} is out of range")
        values = np.frombuffer(body, dtype=_F32_LE, count=k, offset=_VALUES_OFFSET)
        out = torch.zeros(numel, dtype=torch.float32)
        out[_positions(seed, numel, k)] = torch.from_numpy(values.astype(np.float32))
        return out
