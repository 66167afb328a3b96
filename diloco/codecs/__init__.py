"""Pure encode/decode of FP32 vectors for the swarm (docs/design.md "Codecs"); no I/O, imports
nothing of ours.

``get_codec(name)`` for configuration, ``codec_for_payload(data)`` for the wire; every
payload starts with a 5-byte header (codec id, element count). ``CodecError`` (a
``ValueError``) is the package's only error.
"""

from diloco.codecs.base import Codec, CodecError, CodecId, Header
from diloco.codecs.registry import CODEC_NAMES, codec_for_payload, get_codec

__all__ = [
    "CODEC_NAMES",
    "Codec",
    "CodecError",
    "CodecId",
    "Header",
    "codec_for_payload",
    "get_codec",
]
