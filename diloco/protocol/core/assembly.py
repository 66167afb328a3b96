"""The member side of one round's reduction, without streams (docs/design.md "The round").

``round`` holds what every member derives from the group (``RoundPlan``) and the reducer side
of a part (``PartReducer``); this module holds what a member does with the parts it gets
back, apart because it is the other end of the exchange and shares none of the reducer's
state:

* ``AveragedPart``: the member side of one reducer's part, one stream's worth: its AVERAGED
  chunks, validated in order.
* ``Assembly``: the parts a member holds and the result, masks and digest they make.

``AveragedPart.decode`` reads nothing that changes while it runs, so the glue runs it in an
executor; every other method is called on the event loop.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from diloco.codecs import CodecError
from diloco.errors import ProtocolError
from diloco.protocol.core.norms import check_reference, num_blocks
from diloco.protocol.core.round import RoundPlan, check_values
from diloco.protocol.wire.frames import Buffer
from diloco.protocol.wire.part import Averaged


class AveragedPart:
    """Part ``part`` as one stream from its reducer delivers it: AVERAGED chunks in order,
    each checked against the plan and the group's median of the norms it reports.

    A stream opened again after a cut starts a new ``AveragedPart``: the reducer streams
    every chunk again from the first.
    """

    def __init__(self, plan: RoundPlan, part: int, reducer: int | None = None) -> None:
        self.plan, self.part = plan, part
        self.reducer = part if reducer is None else reducer
        """The member that averaged it: the part's own, or its substitute."""
        self.chunks = plan.chunks[part]
        self.mask: tuple[bool, ...] | None = None
        self.values: list[torch.Tensor] = []
        self.norms: list[tuple[float, ...]] = []
        """Per chunk, the members' chunk norms as the reducer reported them."""
        self.block_norms: list[tuple[float, ...]] = []
        """Per chunk, the block norms of the reducer's own contribution."""
        self._references: dict[int, float] = {}
        """Per chunk checked, the bound's reference (``norms.check_reference`` of the norms
        the reducer reports: signed, and checked by ``verification``)."""
        self._sha = hashlib.sha256()

    @property
    def complete(self) -> bool:
        return len(self.values) == len(self.chunks)

    def body_size(self, c: int) -> int:
        """The exact body length of AVERAGED chunk ``c``, checked before it is read."""
        a, b = self.chunks[c]
        payload = self.plan.return_codec.encoded_size(b - a)
        return Averaged.body_size(self.plan.num_members, num_blocks((a, b)), payload)

    def check(self, c: int, msg: Averaged) -> None:
        """Raise ProtocolError unless ``msg`` is chunk ``c`` of this part with the same mask,
        counting its reducer, and a block norm per block."""
        if msg.head != self.plan.head(self.part, c):
            raise ProtocolError("AVERAGED for another round, group, part or chunk")
        if len(msg.mask) != self.plan.num_members:
            raise ProtocolError(f"mask of {len(msg.mask)} members")
        if not msg.mask[self.reducer]:
            raise ProtocolError("counted mask without the reducer")
        if self.mask is not None and msg.mask != self.mask:
            raise ProtocolError("counted mask changed mid-part")
        if len(msg.block_norms) != num_blocks(self.chunks[c]):
            raise ProtocolError(f"{len(msg.block_norms)} block norms")
        counted = [norm for norm, bit in zip(msg.norms, msg.mask, strict=True) if bit]
        self._references[c] = check_reference(counted)

    def decode(self, c: int, payload: Buffer) -> torch.Tensor:
        """Decode and validate averaged chunk ``c``, once ``check`` passed its message.

        A mean of contributions clipped at the median norm is within it, so the bound
        (``max_norm_ratio`` times the reported norms' reference) leaves the return codec
        ample room; this member's own norm is no reference (a tiny own delta would refuse
        honest means).

        Raises:
            ProtocolError: no decode, non-finite values, or a norm over the bound.
        """
        try:
            values = self.plan.return_codec.decode(payload)
        except CodecError as exc:
            raise ProtocolError(f"averaged part does not decode: {exc}") from exc
        check_values(values, self._references[c], self.plan.max_norm_ratio)
        return values

    def add(self, c: int, msg: Averaged, values: torch.Tensor, body: Buffer) -> None:
        """Keep chunk ``c``: ``msg`` parsed from ``body``, its payload decoded to ``values``."""
        assert len(self.values) == c, "averaged chunks arrive in order"
        self.mask = msg.mask
        self.values.append(values)
        self.norms.append(msg.norms)
        self.block_norms.append(msg.block_norms)
        self._sha.update(body)

    def digest(self) -> bytes:
        """``part_digest`` of the chunks received, hashed as they came."""
        assert self.complete
        return self._sha.digest()


@dataclass(frozen=True, slots=True)
class Assembled:
    """A member's result after the gather: what it reports and, if agreed, applies."""

    held: tuple[bool, ...]
    """Which parts this member holds."""
    delta: torch.Tensor
    """The averaged vector; zeros where a part is missing (never local values)."""
    digest: bytes
    """sha256 over the part digests of the parts held, in part order."""
    full: tuple[bool, ...]
    """Members counted in every part held: the full contributors."""


class Assembly:
    """The parts this member holds (its own and the averaged parts received)."""

    def __init__(self, plan: RoundPlan) -> None:
        self.plan = plan
        self._parts: dict[int, tuple[tuple[bool, ...], torch.Tensor, bytes]] = {}

    def add(self, part: int, mask: tuple[bool, ...], values: torch.Tensor, digest: bytes) -> None:
        lo, hi = self.plan.spans[part]
        if values.numel() != hi - lo:
            raise ValueError(f"part {part} of {values.numel()} values, expected {hi - lo}")
        self._parts[part] = (mask, values, digest)

    def discard(self, part: int) -> None:
        """Forget part ``part`` (a re-reduction that does not count)."""
        self._parts.pop(part, None)

    def clear(self) -> None:
        """Forget the parts (``result`` has copied them)."""
        self._parts.clear()

    def result(self) -> Assembled:
        n = self.plan.num_members
        delta = torch.zeros(self.plan.numel, dtype=torch.float32)
        for j, (_, values, _) in self._parts.items():
            lo, hi = self.plan.spans[j]
            delta[lo:hi] = values
        digest = hashlib.sha256(b"".join(self._parts[j][2] for j in sorted(self._parts)))
        masks = [mask for mask, _, _ in self._parts.values()]
        return Assembled(
            held=tuple(j in self._parts for j in range(n)),
            delta=delta,
            digest=digest.digest(),
            full=tuple(all(mask[i] for mask in masks) for i in range(n)),
        )
