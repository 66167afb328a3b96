"""Peers refused for a while after repeated offences (docs/design.md "Threat model").

An *offence* is protocol evidence that a peer lied or sent what no honest peer sends: a
contribution that fails validation, a REPORT of a result the majority did not assemble, a
JOIN or GROUP that breaks the run's rules, a reducer that answers neither the checks
of its part nor the dispute (how a lie would hide), and silence past a bound an honest
peer keeps with room to spare: a leader that holds the JOINs and sends no GROUP, a member
that sends a reducer nothing while most of the others did (docs/design.md "Liveness").
Faults an honest peer also has (a cut stream, a slow link, a missing part) are not
offences. Silence is reported as such (``offend(..., silence=True)``): a peer's silences
within ``SILENCE_SPAN`` of one that counted are one offence (a node stopped or asleep is
silent in every round it was in, once), and none is charged while this node itself stood
(``stalls``: then the silence may be its own). A lie proven by the liar's own
signatures (reducer verification) bans at once (``ban``). ``BAN_OFFENCES`` offences within
``BAN_WINDOW`` seconds ban the peer for ``BAN_SECONDS``: its streams are refused at
admission (``streams.stream_handler``'s hook), leaders do not admit it to groups and
followers drop it from their views. Bans and releases are logged with the peer id and the
offence.

One ``BanList`` per node (``Swarm.bans``), shared by matchmaking, the all-reduce, state
transfer and whoever else catches a peer lying (reducer verification, healing): its API is
``offend(peer, reason)``, ``ban(peer, reason)`` and ``banned(peer)``. Thread-safe: the
swarm's loop and the node's threads both report. The clock is injectable, so the rules
test without sleeping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hivemind.p2p import PeerID

from diloco.protocol.trust.stalls import StallWatch
from diloco.protocol.wire.frames import Reject, RejectCode

logger = logging.getLogger(__name__)

BAN_OFFENCES = 3
"""Offences within ``BAN_WINDOW`` that ban a peer: one may be a fluke (a flipped bit in a
volunteer's RAM), three in a row is a pattern."""
BAN_WINDOW = 3600.0
"""Seconds an offence counts toward a ban (several rounds of every fragment)."""
BAN_SECONDS = 3600.0
"""Seconds a ban lasts; then the peer may take part again, from a clean slate."""
SILENCE_SPAN = 60.0
"""Seconds after a counted silence of a peer during which its further silences count no
more: a frozen node's records expire (30 s) and the rounds it was in end within it, so one
stop costs it one offence, while a peer silent on purpose is still banned within
``BAN_OFFENCES`` spans (and a silent peer costs a round little: it is dropped or the next
in line leads)."""


@dataclass(slots=True)
class _Record:
    offences: deque[tuple[float, str]] = field(default_factory=deque)
    banned_until: float | None = None
    reason: str = ""
    silent_at: float | None = None
    """When this peer's last counted silence was."""


class BanList:
    """Offences per peer with their times; a peer with too many recent ones is banned."""

    def __init__(
        self,
        *,
        max_offences: int = BAN_OFFENCES,
        window: float = BAN_WINDOW,
        duration: float = BAN_SECONDS,
        silence_span: float = SILENCE_SPAN,
        clock: Callable[[], float] = time.monotonic,
        stalls: StallWatch | None = None,
    ) -> None:
        if max_offences < 1 or not window > 0 or not duration > 0 or silence_span < 0:
            raise ValueError(
                "need max_offences >= 1, window > 0, duration > 0 and silence_span >= 0 seconds"
            )
        self.max_offences, self.window, self.duration = max_offences, window, duration
        self.silence_span = silence_span
        self.stalls = stalls
        """This node's own stalls (None: not watched, every silence judged is charged)."""
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[PeerID, _Record] = {}

    def offend(self, peer: PeerID, reason: str, *, silence: bool = False) -> bool:
        """Record an offence of ``peer`` (``silence``: it did not answer in time, see the
        module docstring); True if it is banned now (by this or before)."""
        if silence and self.stalls is not None and self.stalls.stalled():
            logger.info("not charging %s, this node stood meanwhile: %s", peer, reason)
            return self.banned(peer)
        now = self._clock()
        with self._lock:
            record = self._peers.setdefault(peer, _Record())
            self._release_if_due(peer, record, now)
            if record.banned_until is not None:
                return True
            if silence:
                if record.silent_at is not None and now - record.silent_at < self.silence_span:
                    span = self.silence_span
                    logger.info("silent again, counted once per %.0f s: %s", span, reason)
                    return False
                record.silent_at = now
            record.offences.append((now, reason))
            while record.offences and record.offences[0][0] <= now - self.window:
                record.offences.popleft()
            logger.warning(
                "offence %d/%d of %s: %s", len(record.offences), self.max_offences, peer, reason
            )
            if len(record.offences) < self.max_offences:
                return False
            record.banned_until, record.reason = now + self.duration, reason
            record.offences.clear()
        logger.warning(
            "banning %s for %.0f s after %d offences, the last: %s",
            peer,
            self.duration,
            self.max_offences,
            reason,
        )
        return True

    def ban(self, peer: PeerID, reason: str) -> None:
        """Ban ``peer`` now, whatever its offences: it was caught in a lie that its own
        signatures prove (``verification``), which no fault of an honest peer produces."""
        now = self._clock()
        with self._lock:
            record = self._peers.setdefault(peer, _Record())
            self._release_if_due(peer, record, now)
            if record.banned_until is not None:
                return
            record.banned_until, record.reason = now + self.duration, reason
            record.offences.clear()
        logger.warning("banning %s for %.0f s: %s", peer, self.duration, reason)

    def banned(self, peer: PeerID) -> bool:
        """Whether ``peer`` is banned now (a ban that ran out is released and logged)."""
        with self._lock:
            record = self._peers.get(peer)
            if record is None:
                return False
            self._release_if_due(peer, record, self._clock())
            return record.banned_until is not None

    def admit(self, peer: PeerID) -> Reject | None:
        """The stream admission hook (``streams.Admission``): refuse a banned peer."""
        if self.banned(peer):
            return Reject(RejectCode.BANNED, reason="banned for repeated protocol offences")
        return None

    def _release_if_due(self, peer: PeerID, record: _Record, now: float) -> None:
        if record.banned_until is not None and now >= record.banned_until:
            record.banned_until, record.silent_at = None, None
            logger.warning("releasing %s: its ban (for %s) ran out", peer, record.reason)
