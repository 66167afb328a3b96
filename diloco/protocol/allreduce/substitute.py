"""Re-reduction of a failed reducer's part among the survivors.

In a butterfly every member reduces one part, so a reducer that dies or stalls after
matchmaking would leave its part missing everywhere and fail the round for all. Instead,
every member for which part ``r`` failed (its stream cut for good, refused, rejected as
failed, invalid, or not there by ``Deadlines.part``) sends its chunks of part ``r`` again,
the same bytes under the same seal, to the part's substitute ``s = substitute(r, M)``
(the next member in group order, derived alike by every member) on an ordinary PART
stream, and takes the average ``s`` returns as part ``r``. The substitute serves it with
its own ``PartServer`` for part ``r`` (``Substitutes``), counting itself and whoever sends
by the halfway mark of the re-reduction window (``Deadlines.rereducing``), and holds the
result itself. Everything is due by ``Deadlines.rereduce``, within the round's deadline.

Rules, the same at every member:

* ``s`` re-reduces part ``r`` only if part ``r`` failed at ``s`` too; if ``s`` holds part
  ``r`` as ``r`` averaged it, it refuses (REJECT BAD_PART) and the members that asked
  miss the part: they fail the round, apply nothing, and heal (no partial update).
* A member whose part stream to ``r`` broke in transport (refused or cut twice) takes ``r``
  for gone (``Substitutes.gone``): it stops waiting for ``r``'s contributions in the
  parts whose gather it has not closed, the re-reduced ones included. So a reducer that
  vanishes after matchmaking is counted nowhere, and the survivors' result is the mean of
  their own contributions. One that dies after its contributions were counted in some
  parts stays counted there (an average is not taken back, as for a late member): the
  masks travel with the parts and ``RoundResult.members`` lists the full contributors.
* The re-reduced part's mask, digest and seal (signed by ``s``) are checked like any
  part's; REPORT and ``agreement.decide`` then cover the re-reduced result. A member that
  holds another version of part ``r`` (``r`` reached it before dying) is in the minority
  and heals.
* Re-reduced parts are **excluded from the sampled checks** (``verification``): the
  checks name a part's reducer by the part's index. A lying substitute is caught only
  when its lie changes the REPORT digests of a majority, i.e. not at all if it sends the
  same bytes to all; the residual risk is one part per failed reducer.
* A member that a reducer refused for another reason than a failed part (``Excluded``)
  does not ask for a re-reduction of that part.
* A re-reduction that counts the substitute alone fails (a group of one is no group:
  two members whose partner died fail their round).
* Only one substitute per part: if ``r`` and ``s`` both fail, part ``r`` is missing and
  the round fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import torch
from hivemind.p2p import PeerID

from diloco.errors import ProtocolError
from diloco.protocol.allreduce.part_server import FAILED, PartServer
from diloco.protocol.core.partition import substitute
from diloco.protocol.wire.frames import Frame, Reject, RejectCode
from diloco.protocol.wire.part import PartHead

logger = logging.getLogger(__name__)

GONE = "its part stream broke: taken for gone"


__all__ = ["FAILED", "GONE", "Excluded", "Substitutes"]


class Excluded(ProtocolError):
    """A reducer refused this member (REJECT other than ``FAILED``: its input was invalid
    or late, it is banned, of another run or group): the part is missing here through
    this member's doing, or the reducer is alive and says so; nothing to re-reduce."""


class Substitutes:
    """This member's side as a substitute: the parts it re-reduces (or declines to), and
    the members it takes for gone."""

    def __init__(
        self, index: int, num_members: int, own: PartServer, clients: Sequence[bool] = ()
    ) -> None:
        self.index, self.num_members, self.own = index, num_members, own
        self.clients = tuple(clients)
        self._decisions: dict[int, asyncio.Future[PartServer | None]] = {}
        self.servers: list[PartServer] = []
        """Part servers of the parts this member re-reduces."""
        self.gone: set[int] = set()

    def covers(self, part: int) -> bool:
        """Whether this member is the substitute of ``part``."""
        return part != self.index and substitute(part, self.num_members, self.clients) == self.index

    def _decision(self, part: int) -> asyncio.Future[PartServer | None]:
        if part not in self._decisions:
            self._decisions[part] = asyncio.get_running_loop().create_future()
        return self._decisions[part]

    def decline(self, part: int) -> None:
        """This member holds ``part`` as its reducer averaged it: it re-reduces nothing."""
        if self.covers(part) and not self._decision(part).done():
            self._decision(part).set_result(None)

    def engage(self, part: int, make: Callable[[], PartServer]) -> PartServer:
        """Serve the re-reduction of ``part`` with the server ``make`` builds."""
        server = make()
        for i in self.gone:
            server.exclude(i, GONE)
        self.servers.append(server)
        self._decision(part).set_result(server)
        return server

    async def reduce(
        self, part: int, make: Callable[[], PartServer], own: Callable[[int], torch.Tensor]
    ) -> str | None:
        """Re-reduce ``part`` here with the server ``make`` builds; ``own(c)`` is this
        member's chunk ``c`` of it as a reducer uses it (run in an executor). Returns why
        the part failed, or None once it is in the assembly."""
        loop = asyncio.get_running_loop()
        server = self.engage(part, make)
        task = asyncio.create_task(server.reduce())
        try:
            for c, future in enumerate(server.own_chunks):
                future.set_result(await loop.run_in_executor(None, own, c))
            await task
        finally:
            task.cancel()
        if server.reducer.failed is None and len(server.reducer.counted) < 2:
            server.assembly.discard(part)  # nobody else asked: nobody else holds it
            return "nobody else sent it: a re-reduction of one is no group"
        return server.reducer.failed

    def mark_gone(self, i: int) -> None:
        """Stop waiting for member ``i``'s contributions wherever a gather is still open."""
        if i in self.gone:
            return
        self.gone.add(i)
        for server in (self.own, *self.servers):
            if not server.reducer.gather_closed:
                server.exclude(i, GONE)

    async def accept_part(
        self,
        sender: PeerID,
        frame: Frame,
        head: PartHead,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        deadline: float,
    ) -> Reject | None:
        """Serve a PART stream for another reducer's part: once this member knows (by
        ``deadline``, loop time) whether it re-reduces that part."""
        if head.part >= self.num_members or not self.covers(head.part):
            return Reject(RejectCode.BAD_PART, reason="not a part this member re-reduces")
        decision = self._decision(head.part)
        remaining = deadline - asyncio.get_running_loop().time()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(decision), max(0.0, remaining))
        server = decision.result() if decision.done() else None
        if server is None:
            return Reject(RejectCode.BAD_PART, reason="part held here: nothing to re-reduce")
        return await server.accept_part(sender, frame, head, reader, writer)
