"""One fragment's outer state and its hash, shared by the trainer, the records and state
transfer (docs/design.md "Algorithm and schedule", 4 "State transfer").

There is one ``FragmentState`` and one hash: the outer loop (``diloco.node.training.outer``) updates
it in place, nodes publish its ``sha256`` in their DHT records, and state transfer serves
and validates it. Nothing here touches the network, so the in-process trainer
(``diloco.node.training.local``) imports it without starting hivemind.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from diloco.errors import ProtocolError


@dataclass
class FragmentState:
    """Outer parameters and momentum of one fragment (1-D FP32 CPU tensors of one length).

    Mutable: the outer optimizer updates the tensors and the version in place. Without
    ``__slots__`` so that a state server can hold weak references to served snapshots
    (``state_transfer.SnapshotHashes``).
    """

    outer: torch.Tensor
    momentum: torch.Tensor
    version: int = 0
    """Round ``k`` of the last applied round (0 before the first)."""

    def sha256(self) -> str:
        """Hex sha256 of the outer parameters then the momentum, FP32 little-endian.

        This is the hash nodes publish in their DHT records and compare to detect divergence,
        and the one a state transfer's header carries.
        """
        digest = hashlib.sha256()
        digest.update(fp32_bytes(self.outer))
        digest.update(fp32_bytes(self.momentum))
        return digest.hexdigest()

    def check(self) -> None:
        """Raise ProtocolError unless both tensors are 1-D FP32 CPU of one length, finite.

        Raises:
            ProtocolError: naming the first thing wrong (a peer's state must not be used).
        """
        for name, x in (("outer", self.outer), ("momentum", self.momentum)):
            if x.dtype != torch.float32 or x.dim() != 1 or x.device.type != "cpu":
                raise ProtocolError(f"{name} must be a 1-D float32 CPU tensor")
            if not bool(torch.isfinite(x).all()):
                raise ProtocolError(f"{name} holds non-finite values")
        if self.outer.numel() != self.momentum.numel():
            raise ProtocolError("outer and momentum differ in length")
        if self.version < 0:
            raise ProtocolError(f"version {self.version} < 0")

    def clone(self) -> FragmentState:
        """A copy that later in-place updates of this one do not change."""
        return FragmentState(self.outer.clone(), self.momentum.clone(), self.version)


@dataclass(frozen=True, slots=True)
class OuterState:
    """A node's outer state as served to joiners and healers: fragments and global step."""

    global_step: int
    fragments: Mapping[int, FragmentState]


def fp32_bytes(x: torch.Tensor) -> bytes:
    """FP32 little-endian bytes of a 1-D tensor (the wire and hash layout), from any device."""
    array = x.detach().to("cpu", torch.float32).contiguous().numpy()
    return array.astype("<f4", copy=False).tobytes()
