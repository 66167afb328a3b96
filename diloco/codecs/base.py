"""The wire header, the codec base class and the one error of ``diloco.codecs`` (docs/design.md
"Codecs").

Every payload, whatever the codec::

    codec id (uint8) | element count n (uint32 LE) | body (codec-specific, see each codec)

The header alone says how long the whole payload must be, so a decoder rejects a truncated or
over-long payload before it reads any value. Byte order is always little-endian; the module
does no I/O.

Errors::

    ValueError
    └── CodecError   bad input to encode, or malformed bytes handed to decode
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

import torch

__all__ = [
    "HEADER_BYTES",
    "MAX_NUMEL",
    "Codec",
    "CodecError",
    "CodecId",
    "Header",
    "check_input",
]

HEADER_FORMAT = "<BI"  # codec id, element count
HEADER_BYTES = struct.calcsize(HEADER_FORMAT)  # 5
MAX_NUMEL = 2**32 - 1


class CodecError(ValueError):
    """An input a codec cannot encode, or a payload it cannot decode."""


class CodecId(IntEnum):
    """The stable one-byte codec ids of the wire format; names are the registry names."""

    NONE = 0
    BF16 = 1
    FP16 = 2
    INT8 = 3
    E3M0 = 4
    DROP = 5
    TOPK = 6


@dataclass(frozen=True)
class Header:
    """The 5-byte header that starts every payload."""

    codec_id: int
    numel: int

    @classmethod
    def parse(cls, data: bytes | bytearray | memoryview) -> Header:
        """Read the header at the start of ``data``.

        Raises:
            CodecError: if ``data`` is shorter than the header or names an unknown codec id.
        """
        try:
            codec_id, numel = struct.unpack_from(HEADER_FORMAT, data, 0)
        except struct.error as exc:
            raise CodecError(
                f"payload of {len(data)} bytes is shorter than the {HEADER_BYTES}-byte header"
            ) from exc
        header = cls(codec_id, numel)
        header.check()
        return header

    def serialize(self) -> bytes:
        """The 5 header bytes."""
        self.check()
        return struct.pack(HEADER_FORMAT, self.codec_id, self.numel)

    def check(self) -> None:
        """Raise CodecError unless the id is a known codec and the count fits uint32.

        Raises:
            CodecError: for an unknown codec id or an element count out of range.
        """
        if self.codec_id not in CodecId._value2member_map_:
            valid = ", ".join(f"{c.value} ({c.name.lower()})" for c in CodecId)
            raise CodecError(f"unknown codec id {self.codec_id}; valid ids: {valid}")
        if not 0 <= self.numel <= MAX_NUMEL:
            raise CodecError(f"element count {self.numel} does not fit in uint32")


def check_input(x: object) -> torch.Tensor:
    """Return ``x`` as a contiguous, detached 1-D float32 CPU tensor, or raise CodecError.

    Raises:
        CodecError: if ``x`` is not a 1-D float32 CPU tensor of at most 2**32 - 1 values.
    """
    if not isinstance(x, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.dim() != 1 or x.device.type != "cpu":
        raise CodecError(
            f"expected a 1-D float32 CPU tensor, got dtype={x.dtype}, "
            f"shape={tuple(x.shape)}, device={x.device}"
        )
    if x.numel() > MAX_NUMEL:
        raise CodecError(f"{x.numel()} values do not fit the uint32 element count")
    return x.detach().contiguous()


class Codec(ABC):
    """Turns a 1-D FP32 vector into bytes and back (docs/design.md "Codecs").

    Subclasses fill the ``_`` hooks; the public methods own the header and every check that
    is common to all codecs. Instances are immutable and safe to share between threads.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    block_size: ClassVar[int] = 1
    """Values per block; divides 256 so that parts cut at multiples of 256 encode alone."""

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> bytes:
        """Encode ``x``; ``generator`` drives stochastic rounding where a codec has it.

        Raises:
            CodecError: if ``x`` is not a 1-D float32 CPU tensor, holds NaN or Inf, or holds a
                value the codec cannot represent (see each codec).
        """
        x = check_input(x)
        header = Header(self.codec_id, x.numel())
        body = self._encode_body(x, generator) if x.numel() else b""
        payload = header.serialize() + body
        assert len(payload) == self.encoded_size(x.numel()), f"{self.name} body size is off"
        return payload

    def decode(self, data: bytes | bytearray | memoryview) -> torch.Tensor:
        """Decode a payload of this codec into a fresh 1-D float32 tensor.

        Raises:
            CodecError: if the payload is too short, names an unknown codec or another codec,
                has the wrong length for its element count, or holds invalid body values.
        """
        numel = self._checked_numel(data)
        if numel == 0:
            return torch.empty(0, dtype=torch.float32)
        return self._decode_body(memoryview(data)[HEADER_BYTES:], numel)

    def decoded_norm(self, data: bytes | bytearray | memoryview) -> float:
        """The L2 norm of ``decode(data)``, summed in FP64 (to about ``1e-12`` relative,
        whatever the order); codecs whose layout allows it get it without building the
        values, several times faster than decoding.

        Raises:
            CodecError: as ``decode``.
        """
        numel = self._checked_numel(data)
        if numel == 0:
            return 0.0
        return self._body_norm(memoryview(data)[HEADER_BYTES:], numel)

    def _checked_numel(self, data: bytes | bytearray | memoryview) -> int:
        """The element count of a payload of this codec whose length matches it."""
        header = Header.parse(data)
        if header.codec_id != self.codec_id:
            other = CodecId(header.codec_id).name.lower()
            raise CodecError(f"payload of codec {other!r} handed to the {self.name!r} decoder")
        expected = self.encoded_size(header.numel)
        if len(data) != expected:
            raise CodecError(
                f"{self.name} payload of {header.numel} values must be {expected} bytes, "
                f"got {len(data)}"
            )
        return header.numel

    def encoded_size(self, numel: int) -> int:
        """Exact payload size in bytes for ``numel`` values, header included."""
        if not 0 <= numel <= MAX_NUMEL:
            raise CodecError(f"element count {numel} does not fit in uint32")
        return HEADER_BYTES + self._body_size(numel)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @abstractmethod
    def _body_size(self, numel: int) -> int:
        """Body bytes for ``numel`` values."""

    @abstractmethod
    def _encode_body(self, x: torch.Tensor, generator: torch.Generator | None) -> bytes:
        """Body bytes for a checked, contiguous, non-empty ``x``."""

    @abstractmethod
    def _decode_body(self, body: memoryview, numel: int) -> torch.Tensor:
        """Values from a body whose length already matches ``numel`` (> 0)."""

    def _body_norm(self, body: memoryview, numel: int) -> float:
        """``decoded_norm`` of a checked body; the default decodes it."""
        return float(torch.linalg.vector_norm(self._decode_body(body, numel), dtype=torch.float64))
