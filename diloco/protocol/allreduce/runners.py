"""``RoundRunners``: builds the all-reduce runners of one round at this node.

``SwarmReducer`` makes one per round, once the round's budget is known, and runs a flat
round on the runner it builds; a staged round gets it (``in_stages``) to build the runner
of each stage group (``staged.runner.RunnerFactory``), so the staged runner never calls
back into the reducer. Every runner it builds shares the round's codecs, budget, bans,
identity and the router's transport.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from diloco.codecs import Codec
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.allreduce.transport import RoundTransport
from diloco.protocol.core.budget import RoundBudget
from diloco.protocol.core.group import GroupInfo
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.identity import Identity


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
    runner_type: type[AllReduceRunner] = AllReduceRunner

    def __call__(self, group: GroupInfo, delta: torch.Tensor, max_weight: float) -> AllReduceRunner:
        """The runner of ``group``'s all-reduce of ``delta`` here, weights capped at
        ``max_weight``."""
        return self.runner_type(
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
        )

    def in_stages(self) -> RoundRunners:
        """The runners of a staged round's stages: their members start a stage as their
        previous stages end, not together, so nobody is dropped as silent by time there,
        only on evidence (``silence``)."""
        return dataclasses.replace(self, drop_by_time=False)
