"""What setting up one member's side of a staged round costs: ``StagedRunner``'s
constructor, which runs on the event loop at the start of every staged round and lists
every view of the member's groups a loss may lead to (``stage_views.candidate_views``).

    python benchmarks/staged_setup.py --members 48,1024,4096 --group-sizes 8,32,16 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time

import torch
from hivemind.p2p import PeerID

from diloco.protocol.core.budget import RoundBudget
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.staged.groups import grid_for
from diloco.protocol.staged.runner import StagedRunner


async def _setup_seconds(group: GroupInfo, max_group_size: int) -> float:
    plan = grid_for(group, max_group_size, math.inf)
    if plan is None:
        raise SystemExit(f"{len(group.members)} members in groups of {max_group_size} run flat")
    start = time.perf_counter()
    StagedRunner(
        group=group,
        plan=plan,
        me=group.members[0],
        delta=torch.zeros(group.numel),
        factory=lambda info, x, cap: None,  # type: ignore[arg-type,return-value]
        budget=RoundBudget.of(RoundTimeouts()),
        max_weight=math.inf,
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", default="48,1024,4096")
    parser.add_argument("--group-sizes", default="8,32,16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = zip(args.members.split(","), args.group_sizes.split(","), strict=True)
    for n, g in ((int(n), int(g)) for n, g in sizes):
        peers = (PeerID(i.to_bytes(4, "big") + bytes(30)) for i in range(n))
        members = tuple(sorted(peers, key=PeerID.to_bytes))
        group = GroupInfo(RoundKey(1, 1), bytes(16), members, (1.0,) * n, 1000, 1, 1)
        times = [asyncio.run(_setup_seconds(group, g)) for _ in range(args.repeats)]
        print(
            f"{n} members in groups of {g}: setup {statistics.median(times) * 1e3:.1f} ms "
            f"median ({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}) over {args.repeats}"
        )


if __name__ == "__main__":
    main()
