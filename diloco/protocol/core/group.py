"""Frozen records passed between matchmaking and the all-reduce (hivemind ``GroupInfo``).

``RoundTimeouts`` bounds every phase of one fragment round; its relations are checked at
construction so that a follower never gives up on a part before its reducer stopped
waiting for contributions (``AllReduceRunner`` in hivemind checks the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

from hivemind.p2p import PeerID

from diloco.errors import ConfigError
from diloco.protocol.core.reducer import RoundKey


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundTimeouts:
    """Deadlines of one fragment round, in seconds.

    A round takes at most ``total``; the future of ``SwarmReducer.reduce`` resolves by then
    whatever the peers do.
    """

    matchmaking_window: float = 2.0
    """How long a node waits after declaring itself before it reads who else declared."""
    join_timeout: float = 2.0
    """How long a leader waits for the peers it saw to join; followers wait as long for GROUP."""
    sender_timeout: float = 10.0
    """How long a reducer waits for members' parts, from the start of its all-reduce."""
    reducer_timeout: float = 10.0
    """How much longer a member waits for averaged parts after the reducers stopped waiting."""
    report_timeout: float = 3.0
    """How long a member waits for the others' reports once every part is due."""
    verify_timeout: float = 5.0
    """How long a member waits for the answers to its checks after the reports are due, and
    as long again for a reducer's evidence in a dispute (``verification``)."""
    connect_timeout: float = 5.0
    """Opening one stream to a peer."""
    start_floor: float = 1.0
    """Seconds from the all-reduce's start that every contributor has to start sending its
    part, however fast the majority was (``adaptive.start_bound``): members get their GROUP a
    stream's delivery apart, and a loaded machine deschedules a process for hundreds of
    milliseconds (with 0.1 s, honest members of 4-peer rounds of 5M values were dropped on
    two busy cores, and the round's bytes changed)."""

    def __post_init__(self) -> None:
        for name in (
            "matchmaking_window",
            "join_timeout",
            "sender_timeout",
            "reducer_timeout",
            "report_timeout",
            "verify_timeout",
            "connect_timeout",
            "start_floor",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.connect_timeout > self.sender_timeout:
            raise ConfigError(
                f"connect_timeout ({self.connect_timeout}) must not exceed sender_timeout "
                f"({self.sender_timeout}); raise sender_timeout"
            )

    @property
    def group_timeout(self) -> float:
        """How long after its leader must have chosen its role a follower waits for the
        GROUP: the leader's last read of the round (bounded by a join timeout) and its wait
        for the peers it saw to join (another). A leader silent for longer commits an
        offence and the next in line leads (docs/design.md "Liveness")."""
        return 2 * self.join_timeout

    @property
    def matchmaking(self) -> float:
        """Upper bound of group formation: the window, then joins and redirects, and one
        takeover from a leader that sent no GROUP (a join timeout more)."""
        return self.matchmaking_window + 3 * self.join_timeout

    @property
    def rereduce_timeout(self) -> float:
        """How long, after the parts were due, the survivors may re-reduce the part of a
        reducer that failed (``allreduce`` "Churn"): as long as a reducer's own window."""
        return self.reducer_timeout

    @property
    def allreduce(self) -> float:
        """Upper bound of the all-reduce, a re-reduction and the report exchange."""
        return (
            self.sender_timeout + self.reducer_timeout + self.rereduce_timeout + self.report_timeout
        )

    @property
    def verification(self) -> float:
        """Upper bound of the checks of a round and of a dispute after them."""
        return 2 * self.verify_timeout

    @property
    def reply_timeout(self) -> float:
        """Writing one small frame (ACK, REJECT, GROUP) to a stream that is open: bounded
        like opening one, a round trip at most."""
        return self.connect_timeout

    @property
    def total(self) -> float:
        """Upper bound of a whole round, with a second of slack for local work."""
        return self.matchmaking + self.allreduce + self.verification + 1.0

    def scaled(self, factor: float) -> RoundTimeouts:
        """Every timeout multiplied by ``factor`` (tests use one time unit)."""
        return RoundTimeouts(
            matchmaking_window=self.matchmaking_window * factor,
            join_timeout=self.join_timeout * factor,
            sender_timeout=self.sender_timeout * factor,
            reducer_timeout=self.reducer_timeout * factor,
            report_timeout=self.report_timeout * factor,
            verify_timeout=self.verify_timeout * factor,
            connect_timeout=self.connect_timeout * factor,
            start_floor=self.start_floor * factor,
        )


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """An assembled group for one round, identical on every member.

    ``members`` are in group order (sorted peer id bytes): member ``j`` reduces part ``j``.
    ``weights`` are the members' announced weights (tokens since their last sync).
    ``clients`` marks the members that reduce nothing (their part is empty); empty: none.
    """

    key: RoundKey
    group_id: bytes
    members: tuple[PeerID, ...]
    weights: tuple[float, ...]
    numel: int
    codec_id: int
    return_codec_id: int
    clients: tuple[bool, ...] = ()

    def is_client(self, index: int) -> bool:
        """Whether member ``index`` reduces no part."""
        return bool(self.clients) and self.clients[index]

    def index(self, peer: PeerID) -> int:
        """Group index of ``peer``; raises ValueError if it is not a member."""
        return self.members.index(peer)

    @property
    def names(self) -> tuple[str, ...]:
        """Members as base58 strings, the form ``RoundResult.members`` uses."""
        return tuple(peer.to_base58() for peer in self.members)
