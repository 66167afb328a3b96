"""What a reducer sends back on a member's PART stream, read and checked by the member
(docs/design.md "The round"): one AVERAGED frame per chunk of the part, or a REJECT that
says why not; then the SEAL over the whole averaged part, signed by the reducer when the
round is verified.

``AllReduceRunner`` (``member``) opens the stream and sends the part; this reads the reply
into an ``AveragedPart``. Large chunks are decoded in the executor, small ones on the loop
(``offload``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from diloco.errors import ProtocolError
from diloco.protocol.allreduce.substitute import FAILED, Excluded
from diloco.protocol.core.assembly import AveragedPart
from diloco.protocol.core.round import RoundPlan
from diloco.protocol.runtime.offload import offload
from diloco.protocol.runtime.streams import read_body, read_frame, read_frame_header
from diloco.protocol.trust.round_signatures import verify_averaged
from diloco.protocol.wire.check import Seal
from diloco.protocol.wire.frames import MAX_SMALL_BODY, ByteCounter, Kind, Reject, RejectCode
from diloco.protocol.wire.part import Averaged


def span_len(span: tuple[int, int]) -> int:
    """Values in ``[a, b)``: the size of a chunk's CPU work (``offload``)."""
    return span[1] - span[0]


async def read_reply(
    reader: asyncio.StreamReader,
    part: AveragedPart,
    plan: RoundPlan,
    counter: ByteCounter,
    *,
    signer: str | None,
    on_chunk: Callable[[], None],
    on_not_member: Callable[[], None],
) -> None:
    """Read part ``part.part``'s averaged chunks and its SEAL into ``part``.

    ``signer`` is the reducer's name when the SEAL must carry its signature (None: an
    unverified round); ``on_chunk`` is called as each valid chunk arrives, ``on_not_member``
    when the reducer refuses the stream as not its group's.

    Raises:
        Excluded: the reducer refused this member's contribution (its own doing: nothing to
            re-reduce).
        ProtocolError: the reducer failed the part, or its reply is malformed.
    """
    j = part.part
    for c in range(len(part.chunks)):
        frame = await read_frame_header(reader, counter)
        if frame.kind == Kind.REJECT and frame.body_len <= MAX_SMALL_BODY:
            reject = Reject.parse(await read_body(reader, frame.body_len, counter))
            if reject.code == RejectCode.NOT_MEMBER:
                on_not_member()
            failed = reject.code == RejectCode.BAD_PART and reject.reason.startswith(FAILED)
            error = ProtocolError if failed else Excluded
            raise error(f"rejected: {reject.code.name} {reject.reason}")
        expected = part.body_size(c)
        if frame.kind != Kind.AVERAGED or frame.body_len != expected:
            raise ProtocolError(f"{frame.kind.name} of {frame.body_len} bytes, expected {expected}")
        body = await read_body(reader, frame.body_len, counter)
        msg = Averaged.parse(body)
        part.check(c, msg)
        on_chunk()
        values = await offload(span_len(plan.chunks[j][c]), part.decode, c, msg.payload)
        part.add(c, msg, values, body)
    _, body = await read_frame(reader, (Kind.SEAL,), Seal.SIZE, counter)
    seal = Seal.parse(body)
    if seal.head != plan.seal_head(j):
        raise ProtocolError("SEAL of another part")
    if signer is not None:
        verify_averaged(signer, seal.head, part.digest(), seal.signature)  # on the loop: one
