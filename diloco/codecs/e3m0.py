"""E3M0: 4-bit floats in blocks of 32 sharing an E8M0 power-of-two scale (docs/design.md "Codecs").

Layout (after the 5-byte header; ``nb = ceil(n / 32)`` blocks, the last zero-padded)::

    scale bytes: nb x uint8 (E8M0)  | codes: nb x 16 bytes, two 4-bit codes per byte,
                                    |        first value of a pair in the LOW nibble
                                                                 5 + 17*nb bytes

Scale byte ``b`` means ``scale = 2**(b - 127)``; ``b = 255`` is invalid. Code bits: bit 3 the
sign, bits 0-2 the exponent field ``e``; ``e = 0`` is zero (the encoder always writes code
0 for it), ``e = 1..7`` is ``scale * 2**(e - 7)``. A block thus represents 0 and
``scale * {2**-6, ..., 2**-1, 1}``: 15 values with the signs.

``2**(b - 127)`` is the smallest power of two not below the block's absmax (``b = 0`` for an
all-zero block and for blocks whose absmax is below ``2**-127``); ``|x| > 2**127`` cannot be
encoded.

Nearest rounding (ties away from zero) error bound, with ``r = |x| / scale`` in ``[0, 1]``:

- ``r < 2**-6``: the neighbours are 0 and ``2**-6``, so ``|err| <= scale * 2**-7``;
- ``2**-j <= r <= 2**(1-j)`` (j = 1..6): the gap is ``2**-j``, so ``|err| <= scale * 2**-(j+1)``,
  at most ``r / 3`` (the worst case is the midpoint ``r = 1.5 * 2**-j``).

Hence ``|err| <= max(scale * 2**-7, |x| / 3)``. Stochastic rounding goes to a neighbour
``lo <= r <= hi`` with ``P(hi) = (r - lo) / (hi - lo)``, so ``E[decode(encode(x))] = x`` and
``|err| < hi - lo``.

A part cut at multiples of 32 values (in particular 256) encodes, with nearest rounding, to
exactly the scale bytes and code bytes of the same blocks in the whole vector.

Re-encoding with nearest rounding: ``decode(encode(.))`` and ``encode(decode(.))`` are both
idempotent, bit for bit. ``encode(decode(encode(x)))`` equals ``encode(x)`` except in blocks
whose absmax rounded down to ``scale / 2``: by the scale rule those re-encode one binade lower
(``b - 1``, every field ``+ 1``), to the same values.
"""

from __future__ import annotations

import numpy as np
import torch

from diloco.codecs.base import Codec, CodecError, CodecId

__all__ = ["ROUNDINGS", "E3M0Codec"]

BLOCK_SIZE = 32
ROUNDINGS = ("nearest", "stochastic")
SCALE_BIAS = 127
INVALID_SCALE_BYTE = 255
MAX_EXPONENT_FIELD = 7
# Body: scale bytes (nb x uint8) | codes (nb x 16 bytes); offsets are functions of nb.
_SCALES_OFFSET = 0
_CODE_BYTES_PER_BLOCK = BLOCK_SIZE // 2
_SIGN_BIT = 8

# FP32 bit-level constants: r = |x| / scale lies in [0, 1], so its biased exponent says its
# power-of-two bracket, and its top mantissa bit says whether it lies above the midpoint.
_MANTISSA_BITS = 23
_HALF_ULP_OF_EXPONENT = 1 << (_MANTISSA_BITS - 1)  # adds 1 to the exponent iff m >= 1.5
_EXPONENT_OFFSET = 127 - MAX_EXPONENT_FIELD  # e = biased exponent of r - 120
_ZERO_THRESHOLD_BITS = _EXPONENT_OFFSET << _MANTISSA_BITS  # bits of 2**-7, half of 2**-6
_LOWEST_LEVEL_BITS = (_EXPONENT_OFFSET + 1) << _MANTISSA_BITS  # bits of 2**-6
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_ONE_BITS = 127 << _MANTISSA_BITS  # bits of 1.0

# The two values (low nibble first) of every code byte at scale 1, exact powers of two or
# zero: (256, 2). Decoding multiplies them by the block's power-of-two scale, which is exact.
_codes = torch.arange(256)
_nibbles = torch.stack((_codes & 15, _codes >> 4), dim=-1)  # (256, 2)
_PAIR_VALUES = torch.where(
    (_nibbles & 7) > 0,
    torch.ldexp(1.0 - 2.0 * (_nibbles >= _SIGN_BIT), (_nibbles & 7) - MAX_EXPONENT_FIELD),
    0.0,
).to(torch.float32)
# Sum of the squares of a code byte's two values at scale 1, in FP64: every sum of such
# squares over a block is exact (levels 2**-12 .. 1, 32 of them), so the norm of a body is
# its blocks' sums times the squared scales, with FP64 rounding only in the final sum.
_PAIR_SQUARES = _PAIR_VALUES.double().square().sum(dim=1).numpy()
del _codes, _nibbles


def _num_blocks(numel: int) -> int:
    return -(-numel // BLOCK_SIZE)


def _codes_offset(num_blocks: int) -> int:
    return _SCALES_OFFSET + num_blocks


class E3M0Codec(Codec):
    """4.25 bits per value: one E8M0 scale byte and 32 4-bit codes per block."""

    name = "e3m0"
    codec_id = CodecId.E3M0
    block_size = BLOCK_SIZE

    def __init__(self, rounding: str = "nearest") -> None:
        if rounding not in ROUNDINGS:
            raise CodecError(f"unknown e3m0 rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
        self.rounding = rounding

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rounding={self.rounding!r})"

    def _body_size(self, numel: int) -> int:
        return (1 + _CODE_BYTES_PER_BLOCK) * _num_blocks(numel)

    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        scale_bytes, packed = self.encode_blocks(x, generator)
        return scale_bytes.numpy().tobytes() + packed.numpy().tobytes()

    def encode_blocks(
        self, x: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The body of ``encode`` before it becomes bytes, on ``x``'s device: scale bytes
        (nb,) and packed codes (nb, 16), uint8. A GPU can quantise here and copy 4.25 bits
        per value to the host; ``encode`` itself takes CPU tensors only (docs/design.md "Codecs").

        Raises:
            CodecError: ``x`` holds NaN or Inf, or a value beyond ``2**127``.
        """
        n, nb = x.numel(), _num_blocks(x.numel())
        padded = x if n == nb * BLOCK_SIZE else torch.nn.functional.pad(x, (0, nb * BLOCK_SIZE - n))
        blocks = padded.view(nb, BLOCK_SIZE)  # (nb, 32)
        r = blocks.abs()  # becomes |x| / scale, then its bits become the exponent fields
        scale_bytes = self._scale_bytes(r.amax(dim=1))  # (nb,)
        # A product by a power of two is exact (results below 2**-126 round to code 0 anyway).
        ones = torch.ones(nb, device=x.device)
        inverse_scale = torch.ldexp(ones, SCALE_BIAS - scale_bytes.to(torch.int32))
        r.mul_(inverse_scale[:, None])
        bits = r.view(torch.int32)  # (nb, 32)
        if self.rounding == "nearest":
            nonzero = self._nearest_fields_(bits)
        else:
            nonzero = self._stochastic_fields_(bits, generator)
        codes = bits.to(torch.uint8)
        sign_bits = (blocks < 0).logical_and_(nonzero).view(torch.uint8)  # zero: code 0
        codes.bitwise_or_(sign_bits.bitwise_left_shift_(3))
        pairs = codes.view(nb, _CODE_BYTES_PER_BLOCK, 2)  # (nb, 16, 2)
        packed = pairs[..., 1] << 4
        packed.bitwise_or_(pairs[..., 0])  # (nb, 16)
        return scale_bytes, packed

    @staticmethod
    def _scale_bytes(absmax: torch.Tensor) -> torch.Tensor:
        """E8M0 byte of the smallest power of two not below each absmax: (nb,) uint8."""
        if not bool(torch.isfinite(absmax).all()):
            raise CodecError("input holds NaN or Inf; non-finite values are never sent")
        mantissa, exponent = torch.frexp(absmax)  # absmax = mantissa * 2**exponent
        # An exact power of two (mantissa 0.5) is its own scale; anything else rounds up.
        log2_scale = exponent - (mantissa == 0.5).to(torch.int32)
        if bool((log2_scale > INVALID_SCALE_BYTE - 1 - SCALE_BIAS).any()):
            raise CodecError("e3m0 cannot encode |x| > 2**127; scale the vector or use fp32")
        log2_scale.masked_fill_(absmax == 0, -SCALE_BIAS)  # frexp(0) has exponent 0
        return (log2_scale + SCALE_BIAS).clamp_(min=0).to(torch.uint8)

    @staticmethod
    def _nearest_fields_(bits: torch.Tensor) -> torch.Tensor:
        """Turn the bits of r into the nearest value's exponent field (ties up), in place.

        Returns where the field is non-zero (bool).
        """
        nonzero = bits >= _ZERO_THRESHOLD_BITS  # r >= 2**-7, halfway from 0 to 2**-6
        # Rounding the exponent up when the mantissa is >= 1.5 picks the nearer of the two
        # bracketing powers of two (the linear midpoint of 2**k and 2**(k+1) is 1.5 * 2**k);
        # r in [2**-7, 2**-6) goes to the lowest level, e = 1.
        bits.add_(_HALF_ULP_OF_EXPONENT).bitwise_right_shift_(_MANTISSA_BITS)
        bits.sub_(_EXPONENT_OFFSET).clamp_(min=1).mul_(nonzero)
        return nonzero

    @staticmethod
    def _stochastic_fields_(bits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Turn the bits of r into a randomly rounded exponent field (unbiased), in place.

        Returns where the field is non-zero (bool).
        """
        r = bits.view(torch.float32)
        at_least_lowest = bits >= _LOWEST_LEVEL_BITS
        # Within [2**k, 2**(k+1)] the fraction (r - lo) / (hi - lo) is the mantissa field,
        # read exactly as 1.mantissa - 1; below 2**-6 the neighbours are 0 and 2**-6.
        p_up = (bits & _MANTISSA_MASK).bitwise_or_(_ONE_BITS).view(torch.float32).sub_(1.0)
        torch.where(at_least_lowest, p_up, r * 2.0**6, out=p_up)
        up = torch.rand(r.shape, generator=generator, device=r.device) < p_up
        bits.bitwise_right_shift_(_MANTISSA_BITS).sub_(_EXPONENT_OFFSET).clamp_(min=0)
        bits.add_(up)
        return bits > 0

    @staticmethod
    def decode_blocks(scale_bytes: torch.Tensor, packed: torch.Tensor, numel: int) -> torch.Tensor:
        """The values of ``encode_blocks``' output, on its device (FP32, ``numel``); no
        checks: ``decode`` is the one for bytes from peers."""
        table = _PAIR_VALUES.to(packed.device)
        out = table[packed.reshape(-1).long()].view(-1, BLOCK_SIZE)  # (nb, 32)
        ones = torch.ones(out.size(0), device=out.device)
        out.mul_(torch.ldexp(ones, scale_bytes.to(torch.int32) - SCALE_BIAS)[:, None])
        return out.view(-1)[:numel]

    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        nb = _num_blocks(numel)
        scale_bytes = torch.from_numpy(_scale_bytes_of(body, nb))
        packed = np.frombuffer(
            body, dtype=np.uint8, count=nb * _CODE_BYTES_PER_BLOCK, offset=_codes_offset(nb)
        )
        pairs = np.take(_PAIR_VALUES.numpy(), packed, axis=0)  # (nb * 16, 2)
        out = torch.from_numpy(pairs).view(nb, BLOCK_SIZE)
        out.mul_(torch.ldexp(torch.ones(nb), scale_bytes - SCALE_BIAS)[:, None])
        out = out.view(-1)
        return out if numel == out.numel() else out[:numel].clone()

    def _body_norm(self, body: memoryview, numel: int) -> float:
        """Per block, the exact sum of squares at scale 1 times the squared scale: about
        four times faster than decoding."""
        nb = _num_blocks(numel)
        squared_scales = np.ldexp(1.0, 2 * (_scale_bytes_of(body, nb) - SCALE_BIAS))
        packed = np.frombuffer(
            body, dtype=np.uint8, count=nb * _CODE_BYTES_PER_BLOCK, offset=_codes_offset(nb)
        )
        per_block = _PAIR_SQUARES[packed].reshape(nb, _CODE_BYTES_PER_BLOCK).sum(axis=1)
        tail = numel - (nb - 1) * BLOCK_SIZE
        if tail < BLOCK_SIZE:  # padding codes count for nothing, as in decode, whatever they hold
            last = _PAIR_VALUES.numpy()[packed[-_CODE_BYTES_PER_BLOCK:]].reshape(-1)[:tail]
            per_block[-1] = np.square(last.astype(np.float64)).sum()
        return float(np.sqrt(per_block @ squared_scales))


def _scale_bytes_of(body: memoryview, num_blocks: int) -> np.ndarray:
    """The scale bytes of a body as int32; raises CodecError for the invalid byte 255."""
    scale_bytes = np.frombuffer(body, dtype=np.uint8, count=num_blocks, offset=_SCALES_OFFSET)
    if bool((scale_bytes == INVALID_SCALE_BYTE).any()):
        raise CodecError(f"e3m0 payload holds the invalid scale byte {INVALID_SCALE_BYTE}")
    return scale_bytes.astype(np.int32)
