"""How a staged round ends when one member dies at a random moment: 12 members
in groups of 4 (a 3x4 grid) in one process over in-memory streams (the tests'
``memory_p2p``), the wire code of ``StagedRunner`` unchanged, each stream open and each
stage runner start delayed by a random few tens of milliseconds, one member killed per
round.

    python benchmarks/staged_losses.py --rounds 100 --die when-reducing

``--die when-reducing``: the victim dies in stage 0 or 1 once its own part has a first
contribution (the swarm tests' fault); ``--die at-random``: at a random time up to 0.4 s
after its stage-0 or stage-1 runner starts (it may then die while delivering, reporting,
or after the stage). Each round is classed by the survivors' results:

* ``agree``: all 11 hold the same bytes, those of the in-process reference
  (``staged_mean``) with the victim lost in the stage it died in, or, when it died after
  its stage had counted it, in the next one;
* ``partial``: some survivors fail (they apply nothing and heal), the others agree on one
  of those values;
* ``diverged``: two survivors hold different successful values, or a value no reference
  has: the guarantee broken (must stay 0);
* ``failed``: every survivor fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import random
import sys
from pathlib import Path
from typing import Any

import torch
from hivemind.p2p import PeerID

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "protocol"))
from memory_p2p import MemoryNetwork, MemoryP2P
from staged_memory import N, deltas, run_round, runner

from diloco.codecs import get_codec
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.allreduce.routing import RoundRouter
from diloco.protocol.core.group import GroupInfo
from diloco.protocol.core.reducer import RoundResult
from diloco.protocol.staged.reference import staged_mean
from diloco.protocol.staged.runner import RunnerFactory
from diloco.protocol.trust.bans import BanList


class _SlowP2P(MemoryP2P):
    """Opens each stream after a random delay of up to 30 ms."""

    def __init__(self, network: MemoryNetwork, peer_id: PeerID, rng: random.Random) -> None:
        super().__init__(network, peer_id)
        self.rng = rng

    async def call_binary_stream_handler(self, peer_id: PeerID, handler_name: str) -> Any:
        await asyncio.sleep(self.rng.random() * 0.03)
        return await super().call_binary_stream_handler(peer_id, handler_name)


class _SlowNetwork(MemoryNetwork):
    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    def join(self, peer_id: PeerID) -> MemoryP2P:
        p2p = _SlowP2P(self, peer_id, self.rng)
        self.peers[peer_id] = p2p
        return p2p


async def _round(
    seed: int, victim: int, stage: int, die: str, delay: float
) -> tuple[Any, list[Any]]:
    """The plan and every member's result (or exception) of one round."""
    rng = random.Random(seed)

    def factory(i: int, transport: MemoryP2P, bans: BanList, router: RoundRouter) -> RunnerFactory:
        started = [0]

        def make(info: GroupInfo, x: torch.Tensor, cap: float) -> AllReduceRunner:
            made = runner(AllReduceRunner, transport, bans, router, "none", None, info, x, cap)
            dying = i == victim and started[0] == stage
            started[0] += 1
            if dying and die == "at-random":
                asyncio.get_running_loop().call_later(delay, transport.kill)
            run = made.run

            async def delayed() -> RoundResult:
                await asyncio.sleep(rng.random() * 0.05)
                if not (dying and die == "when-reducing"):
                    return await run()
                running = asyncio.ensure_future(run())
                while not made.server.reducer.received and not running.done():
                    await asyncio.sleep(0.01)
                transport.kill()
                return await running

            made.run = delayed  # type: ignore[method-assign]
            return made

        return make

    return await run_round("none", factory, victim, _SlowNetwork(rng))


def classify(plan: Any, results: list[Any], victim: int, stage: int) -> str:
    values, codec = deltas(), get_codec("none")
    live = [i for i in range(N) if i != victim]
    references = {
        staged_mean(plan, values, codec, lost={victim: s}).values[live[0]].numpy().tobytes()
        for s in range(stage, plan.num_stages)
    }
    held = [results[i] for i in live]
    values = {r.delta.numpy().tobytes() for r in held if isinstance(r, RoundResult)}
    if not values:
        return "failed"
    if len(values) > 1 or not values <= references:
        return "diverged"
    return "agree" if all(isinstance(r, RoundResult) for r in held) else "partial"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--die", choices=["when-reducing", "at-random"], default="when-reducing")
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # the victim's own failures would fill the screen
    counts: collections.Counter[str] = collections.Counter()
    for seed in range(args.seed, args.seed + args.rounds):
        rng = random.Random(seed * 7919)
        victim, stage, delay = rng.randrange(N), rng.choice([0, 1]), rng.random() * 0.4
        plan, results = asyncio.run(_round(seed, victim, stage, args.die, delay))
        outcome = classify(plan, results, victim, stage)
        counts[outcome] += 1
        if outcome != "agree":
            failed = sum(1 for r in results if not isinstance(r, RoundResult)) - 1
            print(f"seed {seed}: victim {victim} in stage {stage}: {outcome}, {failed} failed")
    print(", ".join(f"{k} {counts[k]}" for k in ("agree", "partial", "diverged", "failed")))


if __name__ == "__main__":
    main()
