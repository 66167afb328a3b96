"""Codec lookup by name (configuration) and by id byte (the wire), docs/design.md "Codecs"

The registry is checked against ``CodecId`` at import time, so a codec added to one table and
not the other fails loudly at the first import instead of on a peer's payload.
"""

from __future__ import annotations

from typing import Any

from diloco.codecs.base import Codec, CodecError, CodecId, Header
from diloco.codecs.cast import BF16Codec, FP16Codec, NoneCodec
from diloco.codecs.drop import DropCodec
from diloco.codecs.e3m0 import E3M0Codec
from diloco.codecs.int8 import Int8Codec
from diloco.codecs.topk import TopKCodec

__all__ = ["CODEC_NAMES", "codec_for_payload", "get_codec"]

_REGISTRY: dict[str, type[Codec]] = {
    cls.name: cls
    for cls in (NoneCodec, BF16Codec, FP16Codec, Int8Codec, E3M0Codec, DropCodec, TopKCodec)
}


def _check_registry() -> None:
    """Every id has exactly one class, registered under its id's name."""
    ids = {cls.codec_id: name for name, cls in _REGISTRY.items()}
    expected = {member.value: member.name.lower() for member in CodecId}
    if ids != expected or len(ids) != len(_REGISTRY):
        raise RuntimeError(f"codec registry {ids} does not match the id table {expected}")


_check_registry()

CODEC_NAMES: tuple[str, ...] = tuple(
    CodecId(i).name.lower() for i in sorted(cls.codec_id for cls in _REGISTRY.values())
)
_BY_ID: dict[int, type[Codec]] = {cls.codec_id: cls for cls in _REGISTRY.values()}


def get_codec(name: str, **options: Any) -> Codec:
    """The codec registered as ``name``, built with ``options`` (e.g. ``rounding=``).

    Raises:
        CodecError: for an unknown name or options the codec does not take.
    """
    try:
        cls = _REGISTRY[name]
    except (KeyError, TypeError) as exc:
        raise CodecError(f"unknown codec {name!r}; valid names: {', '.join(CODEC_NAMES)}") from exc
    try:
        return cls(**options)
    except TypeError as exc:
        raise CodecError(f"codec {name!r} does not take options {sorted(options)}") from exc


def codec_for_payload(data: bytes | bytearray | memoryview) -> Codec:
    """The codec (with default options) named by a payload's id byte; the body is unread.

    Raises:
        CodecError: if ``data`` is shorter than the header or names an unknown codec id.
    """
    return _BY_ID[Header.parse(data).codec_id]()
