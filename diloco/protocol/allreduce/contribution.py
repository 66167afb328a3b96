"""What a member sends as a contributor to a round (docs/design.md "The round").

``AllReduceRunner`` (``member``) inherits these and sets the state they use: they turn this
member's delta into the bytes it sends, apart from the runner's streams and deadlines. Each
chunk is encoded once (a stream opened again after a cut resends the same bytes, which the
seal covers), sealed per part, and recorded for the checks this member answers later
(``checking``); its own part is the codec's round trip, as its reducer uses it.
"""

from __future__ import annotations

import asyncio
import hashlib

import torch

from diloco.protocol.core.round import RoundPlan
from diloco.protocol.core.verification import OwnContribution
from diloco.protocol.runtime.offload import offload
from diloco.protocol.trust.identity import Identity
from diloco.protocol.trust.round_signatures import sign_part
from diloco.protocol.wire.check import Seal
from diloco.protocol.wire.frames import SIGNATURE_BYTES
from diloco.protocol.wire.part import PartHead


class Contributor:
    """A member's chunks encoded, sealed and recorded; ``AllReduceRunner`` sets the state."""

    plan: RoundPlan
    delta: torch.Tensor
    index: int
    identity: Identity | None
    own: OwnContribution | None
    _sent: dict[tuple[int, int], tuple[bytes, bytes]]
    _part_records: dict[int, asyncio.Future[None]]
    _recorded: asyncio.Event

    def _encode_chunk(self, j: int, c: int) -> bytes:
        """Payload of chunk ``c`` of part ``j`` (sent to reducer ``j``)."""
        a, b = self.plan.chunks[j][c]
        return self.plan.codec.encode(self.delta[a:b].contiguous())

    def _own_chunk(self, c: int) -> torch.Tensor:
        """Chunk ``c`` of this member's own part as its reducer (itself) uses it."""
        a, b = self.plan.chunks[self.index][c]
        payload = self.plan.codec.encode(self.delta[a:b].contiguous())
        values = self.plan.codec.decode(payload)
        if self.own is not None:
            self.own.record(self.index, c, payload, values)
        return values

    def _part_frame(self, j: int, c: int) -> tuple[bytes, bytes]:
        """Head and payload of chunk ``c`` of part ``j`` (in an executor). Encoded once:
        a stream opened again after a cut resends the same bytes, which the seal covers."""
        if (j, c) not in self._sent:
            payload = self._encode_chunk(j, c)
            self._sent[(j, c)] = (payload, hashlib.sha256(payload).digest())
        return self._part_head(j, c).serialize(), self._sent[(j, c)][0]

    def _record_part(self, j: int) -> None:
        """Record this member's chunks of part ``j`` for the checks (their norms; a large
        part's in an executor, ``offload``) once all are sent: while the averaged parts
        are awaited, not after."""
        if self.own is not None and j not in self._part_records:
            chunks = [(j, c, self._sent[(j, c)][0]) for c in range(len(self.plan.chunks[j]))]
            lo, hi = self.plan.spans[j]
            job = asyncio.ensure_future(offload(hi - lo, self.own.record_all, chunks))
            job.add_done_callback(lambda _: self._touch_recorded())
            self._part_records[j] = job

    def stop_answering(self) -> None:
        """Drop what answering checks needs (the delta): every member's checks are over."""
        self.own = None
        self.delta = torch.empty(0)

    def _seal(self, j: int) -> bytes:
        """The SEAL of this member's chunks of part ``j`` (all of them sent)."""
        head = self.plan.seal_head(j)
        if self.identity is None:
            return Seal(head, bytes(SIGNATURE_BYTES)).serialize()
        hashes = [self._sent[(j, c)][1] for c in range(len(self.plan.chunks[j]))]
        return Seal(head, sign_part(self.identity, head, hashes)).serialize()

    def _touch_recorded(self) -> None:
        """Wake ``answer_check``: another chunk was recorded."""
        recorded, self._recorded = self._recorded, asyncio.Event()
        recorded.set()

    def _part_head(self, j: int, c: int) -> PartHead:
        return self.plan.head(j, c)

    def _chunk_sent(self, j: int, c: int) -> torch.Tensor:
        """Chunk ``c`` of part ``j`` of this member's delta as its reducer would use it, the
        codec's round trip (in an executor)."""
        a, b = self.plan.chunks[j][c]
        return self.plan.codec.decode(self.plan.codec.encode(self.delta[a:b].contiguous()))
