"""``RoundRunners``: builds the all-reduce runners of one round at this node.

``SwarmReducer`` makes one per round, once the round's budget is known, and runs a flat
round on the runner it builds; a staged round gets it (``in_stages``) to build the runner
of each stage group (``staged.runner.RunnerFactory``), so the staged runner never calls
back into the reducer. Every runner it builds shares the round's codecs, budget, bans,
identity and the router's transport.

``Faults`` is the one way to put a faulty part into a node's rounds: the classes that run
its side of a group. Tests pass faulty subclasses (a member that lies, stalls or dies); a
node passes none and runs ``AllReduceRunner`` and ``PartServer``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from diloco.codecs import Codec
from diloco.protocol.allreduce.clock import Clock
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.allreduce.part_server import PartServer
from diloco.protocol.allreduce.transport import RoundTransport
from diloco.protocol.core.budget import RoundBudget
from diloco.protocol.core.group import GroupInfo
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.identity import Identity


class Faults(Protocol):
    """Fault injection: which classes run this node's side of ``group`` (module docstring)."""

    def runner_type(self, group: GroupInfo) -> type[AllReduceRunner]:
        """The class of this member's runner (its streams, reports and checks)."""
        ...

    def server_type(self, group: GroupInfo) -> type[PartServer]:
        """The class that serves the parts this member reduces (its own, re-reduced ones)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundRunners:
    """What every all-reduce of one round here shares; called, the runner of one group."""

    transport: RoundTransport
    digest: bytes
    codec: Codec
    return_codec: Codec
    budget: RoundBudget
    max_norm_ratio: float
    clip_factor: float
    bans: BanList
    identity: Identity | None
    drop_by_time: bool = True
    """Whether a member silent at a part's start is dropped by time (``silence``)."""
    faults: Faults | None = None
    """None: the honest classes."""
    clock: Clock | None = None
    """What the runners' timers run on (``clock``); None: the running event loop."""

    def __call__(self, group: GroupInfo, delta: torch.Tensor, max_weight: float) -> AllReduceRunner:
        """The runner of ``group``'s all-reduce of ``delta`` here, weights capped at
        ``max_weight``."""
        faults = self.faults
        runner_type = AllReduceRunner if faults is None else faults.runner_type(group)
        return runner_type(
            transport=self.transport,
            group=group,
            digest=self.digest,
            codec=self.codec,
            return_codec=self.return_codec,
            delta=delta,
            budget=self.budget,
            max_norm_ratio=self.max_norm_ratio,
            max_weight=max_weight,
            clip_factor=self.clip_factor,
            bans=self.bans,
            identity=self.identity,
            drop_by_time=self.drop_by_time,
            server_type=PartServer if faults is None else faults.server_type(group),
            clock=self.clock,
        )

    def in_stages(self) -> RoundRunners:
        """The runners of a staged round's stages: their members start a stage as their
        previous stages end, not together, so nobody is dropped as silent by time there,
        only on evidence (``silence``)."""
        return dataclasses.replace(self, drop_by_time=False)
