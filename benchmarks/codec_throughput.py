"""Codec throughput: encode/decode speed of every ``diloco.codecs`` codec on one core.

Times, on one random-normal FP32 vector (16M values by default) with ``torch.set_num_threads(1)``,
the best of a few repeats of encode and decode for each codec (e3m0 with both roundings), of
hivemind's ``Uniform8BitQuantization`` and ``Float16Compression`` on the same tensor, and of
``torch.Tensor.clone`` as the memory-bandwidth reference. Prints a markdown table; speeds are
MB/s (10**6 bytes) of FP32 input, whatever the encoded size. hivemind's encoded size is its
protobuf message (``ByteSize()``).

    python benchmarks/codec_throughput.py --json benchmarks/results/codec_throughput.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hivemind.compression import CompressionInfo, Float16Compression, Uniform8BitQuantization
from hivemind.proto import runtime_pb2

from diloco.bench.provenance import provenance
from diloco.codecs import get_codec


@dataclass(frozen=True)
class Row:
    name: str
    encode_mb_per_s: float
    decode_mb_per_s: float | None
    encoded_bytes: int
    ratio: float
    relative_rms_error: float


class Uniform8BitQuantizationNumpy2(Uniform8BitQuantization):
    """hivemind 1.1.12's ``Quantization.extract`` calls ``int()`` on a 1-element array, a
    TypeError since numpy 2.4; this is the same extract with that one read fixed."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        shape = tuple(serialized_tensor.size)
        indices = torch.as_tensor(quantized, dtype=torch.int64).reshape(shape)
        values = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
        return values[indices].requires_grad_(serialized_tensor.requires_grad)


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Fastest of ``repeats`` calls: the least disturbed by the other engineers' processes."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(
    name: str,
    x: torch.Tensor,
    encode: Callable[[], Any],
    decode: Callable[[Any], torch.Tensor] | None,
    size: Callable[[Any], int],
    repeats: int,
) -> Row:
    payload = encode()
    input_mb = x.numel() * 4 / 1e6
    encode_s = best_seconds(encode, repeats)
    if decode is None:
        decode_mb, error = None, 0.0
    else:
        decode_mb = input_mb / best_seconds(lambda: decode(payload), repeats)
        error = float((decode(payload).double() - x.double()).norm() / x.double().norm())
    encoded = size(payload)
    return Row(name, input_mb / encode_s, decode_mb, encoded, x.numel() * 4 / encoded, error)


def run(numel: int, repeats: int, seed: int) -> list[Row]:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    rows = []
    for label, name, options in [
        ("none", "none", {}),
        ("bf16", "bf16", {}),
        ("fp16", "fp16", {}),
        ("int8", "int8", {}),
        ("e3m0 nearest", "e3m0", {}),
        ("e3m0 stochastic", "e3m0", {"rounding": "stochastic"}),
    ]:
        codec = get_codec(name, **options)
        generator = torch.Generator().manual_seed(seed)
        rows.append(
            measure(
                label, x, lambda c=codec, g=generator: c.encode(x, g), codec.decode, len, repeats
            )
        )
    info = CompressionInfo.from_tensor(x)
    for label, compression in [
        ("hivemind Uniform8BitQuantization", Uniform8BitQuantizationNumpy2()),
        ("hivemind Float16Compression", Float16Compression()),
    ]:
        rows.append(
            measure(
                label,
                x,
                lambda c=compression: c.compress(x, info, allow_inplace=False),
                compression.extract,
                lambda message: message.ByteSize(),
                repeats,
            )
        )
    clone_bytes: Callable[[torch.Tensor], int] = lambda t: 4 * t.numel()  # noqa: E731
    rows.append(measure("torch clone (reference)", x, x.clone, None, clone_bytes, repeats))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| codec | encode MB/s | decode MB/s | encoded bytes | ratio | rel. RMS error |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        decode = "-" if r.decode_mb_per_s is None else f"{r.decode_mb_per_s:,.0f}"
        error = "-" if r.decode_mb_per_s is None else f"{r.relative_rms_error:.2e}"
        lines.append(
            f"| {r.name} | {r.encode_mb_per_s:,.0f} | {decode} | {r.encoded_bytes:,} "
            f"| {r.ratio:.2f} | {error} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20, help="values (default 16M)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls; the best counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args()

    torch.set_num_threads(1)
    # hivemind's Uniform8BitQuantization uses torch.quantize_per_tensor, deprecated in torch 2.13.
    warnings.filterwarnings("ignore", message="torch.quantize_per_tensor", category=UserWarning)
    rows = run(args.numel, args.repeats, args.seed)
    print(markdown(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "numel": args.numel,
            "repeats": args.repeats,
            "threads": 1,
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "date": time.strftime("%Y-%m-%d"),
            "rows": [asdict(r) for r in rows],
            "provenance": provenance(),
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
