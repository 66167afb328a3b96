"""Time of a round's aggregation (docs/design.md "Aggregation bounds"): ``InProcessReducer``
over one fragment, with the plain mean (C 0) and the robust rules (median weight cap, norm
clipping at C), honest members of equal norm scale and unequal weights.

    nice -n 10 python benchmarks/aggregation_time.py --members 3 8 --numel 4194304 \
        --clip-factors 0 1 --codecs none e3m0
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from diloco.codecs import get_codec
from diloco.protocol.core.reducer import Contribution, InProcessReducer, RoundKey


def seconds_per_round(members: int, numel: int, codec: str, clip: float, repeats: int) -> float:
    """Median wall seconds of one ``reduce`` over ``repeats`` runs (after one warm-up)."""
    generator = torch.Generator().manual_seed(members)
    contributions = [
        Contribution(str(i), torch.randn(numel, generator=generator) * 1e-2, 1.0 + i)
        for i in range(members)
    ]
    reducer = InProcessReducer(get_codec(codec), clip_factor=clip)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        reducer.reduce(RoundKey(0, 1), contributions).result()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--members", type=int, nargs="+", default=[3, 8])
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--clip-factors", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--codecs", nargs="+", default=["none", "e3m0"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| members | codec | C | s per round |")
    print("|---:|---|---:|---:|")
    for members in args.members:
        for codec in args.codecs:
            for clip in args.clip_factors:
                s = seconds_per_round(members, args.numel, codec, clip, args.repeats)
                print(f"| {members} | {codec} | {clip:g} | {s:.3f} |", flush=True)


if __name__ == "__main__":
    main()
