"""What each stage of a staged round adds to the codec's error.

For N members with deltas ``common + own`` (both standard normal, so members agree about
as much as their noise) and token weights drawn in [1000, 3000], reduce along the grid plan
(``diloco.protocol.staged.reference``) and flat (one group), and print relative RMS errors
``||x - exact|| / ||exact||`` against the FP64 weighted mean:

* ``added``: a stage's output against the exact weighted mean of the values it was given
  (the decoded sub-cell means): the error that stage's two encodings add;
* ``cumulative``: a stage's output against the exact weighted mean of its cell's raw deltas.

Also checks that every member ends with the same bytes.

    python benchmarks/staged_error.py --values 1048576 --members 12,48 --group-sizes 4,8
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from diloco.codecs import get_codec
from diloco.protocol.staged.grid import plan_grid
from diloco.protocol.staged.reference import staged_mean


def exact_mean(values: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    total = math.fsum(weights)
    acc = torch.zeros_like(values[0], dtype=torch.float64)
    for v, w in zip(values, weights, strict=True):
        acc += v.double() * (w / total)
    return acc


def rel(x: torch.Tensor, exact: torch.Tensor) -> float:
    return float((x.double() - exact).norm() / exact.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=1 << 20)
    parser.add_argument("--members", default="12,48")
    parser.add_argument("--group-sizes", default="4,8")
    parser.add_argument("--codec", default="e3m0")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    codec = get_codec(args.codec)
    print("| N | groups | shape | stage | added | cumulative | identical | seconds |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | --- | ---: |")
    for n in (int(v) for v in args.members.split(",")):
        gen = torch.Generator().manual_seed(args.seed + n)
        common = torch.randn(args.values, generator=gen)
        deltas = [common + torch.randn(args.values, generator=gen) for _ in range(n)]
        weights = [float(w) for w in torch.randint(1000, 3001, (n,), generator=gen)]
        peers = [f"peer-{i}".encode() for i in range(n)]
        for size in [*(int(v) for v in args.group_sizes.split(",")), n]:
            plan = plan_grid("run/frag0/round1", peers, weights, size)
            start = time.perf_counter()
            result = staged_mean(plan, deltas, codec)
            seconds = time.perf_counter() - start
            first = result.values[0].numpy().tobytes()
            same = all(v.numpy().tobytes() == first for v in result.values)
            label = "flat" if size == n else str(size)
            shape = "x".join(str(side) for side in reversed(plan.shape))
            for s, cells in enumerate(result.cell_means):
                added, cumulative = [], []
                for (lo, hi), value in cells:
                    members = [plan.order[p] for p in range(lo, hi)]
                    raw = exact_mean([deltas[i] for i in members], [weights[i] for i in members])
                    if s == 0:
                        given = raw
                    else:
                        subs = [(c, v) for c, v in result.cell_means[s - 1] if lo <= c[0] < hi]
                        sub_weights = [
                            math.fsum(weights[plan.order[p]] for p in range(*c)) for c, _ in subs
                        ]
                        given = exact_mean([v for _, v in subs], sub_weights)
                    added.append(rel(value, given))
                    cumulative.append(rel(value, raw))
                print(
                    f"| {n} | {label} | {shape} | {s} | {max(added):.4f} | "
                    f"{max(cumulative):.4f} | {'yes' if same else 'NO'} | "
                    f"{seconds if s == 0 else 0:.1f} |"
                )


if __name__ == "__main__":
    main()
