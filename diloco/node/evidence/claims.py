"""What healing and joining may believe of other nodes' claims (docs/design.md "Healing and
joining", "Evidence").

A node record is a claim (its author signed it, nothing more): "I am at step s, I hold
fragment p at version k with hash h". A vouch is another: "applying round k of p left me
at hash h". Keys are free: one process can sign records and vouches under any number of
identities without doing any work. So nothing a node decides about its own outer state or
step rests on counting identities; it rests on ``Evidence``, what the node can check itself:

- the peers it has seen work (``diloco.node.evidence.witness``: members of rounds it applied);
- the run's creator (``RunConfig.creator``, who signed the configuration every node runs);
- while it has seen nobody work yet (a joiner), the anchors its user gave it to join
  through (``--initial-peers``): a joiner follows the run of the peer it was given.

**Claims bounded by the schedule** (``schedule_offence``). A record is *plausible* iff its
global step is at most the run's end ``T`` and every fragment version is at most
``last_sent_round(step, p)`` (an honest node applies round ``k`` at its receive step, and
when it adopts a newer state it moves on to that round's send step: ``donors.catch_up_step``).
A record that breaks the schedule is ignored altogether.

**Adoptable states** (``vouchers``). Only the vouches of *counting* authors count: the
node's witnessed workers and itself, the creator, and (with no worker yet) its anchors.
A state ``(p, k, h)`` is adoptable iff the creator vouches for it, or the counting authors
that vouch for ``h`` are a strict majority of the counting authors that vouch for any hash
of ``(p, k)`` and number at least ``MIN_VOUCHERS`` (one anchor for a joiner). An author
vouching for two hashes of one round counts for neither. The member list a vouch carries
is written by its author and decides nothing (an author absent from its own list is
malformed and ignored). Version 0 needs no vouch: it must be the node's own initial state
(same seed), compared by hash. Vouches of authors that do not count, for states that are
not adoptable, are logged once per author (a paper identity, or an honest newcomer this
node has not worked with yet: the message accuses nobody).

**Robust step and pace** (``assess``). The pace is the lower median step of the plausible
records of the *clock*: the witnessed workers and the creator; while the node has no
witnessed worker, its anchors and the creator. A record whose step runs more than
``PACE_SLACK_ROUNDS * H`` past the pace is not followed (logged once), and the robust step
(where a lagging node skips to, where a joiner starts) is the lower median of the clock's
records within that bound. Records of anyone else never move either: without a clock
record there is no robust step (the run's first node is the swarm's clock; a joiner whose
anchors left starts at the send step of the newest round it adopted). The node's own step
is not in the median: with one partner it would never catch up.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median_low

from diloco.node.model.fragments import last_sent_round, send_step
from diloco.protocol.records.nodes import NodeRecord, Vouch

logger = logging.getLogger(__name__)

MIN_VOUCHERS = 2
"""Counting vouches a state needs at the least (a joiner: one anchor), unless the creator's."""
PACE_SLACK_ROUNDS = 2
"""A record's step may run this many times ``H`` past the swarm's pace (module docstring)."""
MAX_OFFENDERS_LOGGED = 10_000
"""Offenders remembered as logged; beyond, the memory is cleared (Sybils are unbounded)."""

Claim = tuple[int, int, str]
"""A fragment state as records and vouches name it: (fragment, version, state hash)."""


@dataclass(frozen=True, slots=True)
class Schedule:
    """What the run's schedule allows: ``steps`` is T, ``sync_every`` H, ``num_fragments`` F."""

    steps: int
    sync_every: int
    num_fragments: int

    @property
    def pace_slack(self) -> int:
        return PACE_SLACK_ROUNDS * self.sync_every

    def last_round(self, step: int, fragment: int) -> int:
        """The last round of ``fragment`` sent by ``step`` (0: none)."""
        return last_sent_round(step, fragment, self.sync_every, self.num_fragments)

    def send_step(self, fragment: int, round: int) -> int:
        return send_step(fragment, round, self.sync_every, self.num_fragments)


@dataclass(frozen=True, slots=True)
class Evidence:
    """Whose word this node may act on, now (module docstring): its ``workers`` (peers it
    saw counted in rounds it applied, ``Witness.workers``), ``me``, its ``anchors`` and the
    run's ``creator``. Built anew for every check: the workers change as rounds apply."""

    me: str = ""
    workers: frozenset[str] = frozenset()
    anchors: frozenset[str] = frozenset()
    creator: str | None = None

    @property
    def joining(self) -> bool:
        """No witnessed worker yet: the anchors stand in for them."""
        return not self.workers

    def _creator(self) -> frozenset[str]:
        return frozenset() if self.creator is None else frozenset({self.creator})

    def voters(self) -> frozenset[str]:
        """Authors whose vouches count."""
        base = self.anchors if self.joining else self.workers | {self.me}
        return base | self._creator()

    def clock(self) -> frozenset[str]:
        """Peers whose records set the pace and the robust step (not this node itself)."""
        base = self.anchors if self.joining else self.workers
        return (base | self._creator()) - {self.me}

    @property
    def min_vouchers(self) -> int:
        return 1 if self.joining else MIN_VOUCHERS


def _said(
    vouches: Iterable[Vouch], fragment: int, round: int, evidence: Evidence
) -> dict[str, str]:
    """Counting author -> the hash it vouches for at ``(fragment, round)``; authors that
    vouch for two hashes of one round are left out (they count for neither)."""
    voters = evidence.voters()
    hashes: dict[str, set[str]] = defaultdict(set)
    for v in vouches:
        counts = v.author in voters and v.author in v.members
        if counts and (v.fragment, v.round) == (fragment, round):
            hashes[v.author].add(v.state_hash)
    return {author: next(iter(h)) for author, h in hashes.items() if len(h) == 1}


def vouchers(
    vouches: Iterable[Vouch], fragment: int, round: int, state_hash: str, evidence: Evidence
) -> frozenset[str]:
    """The counting authors whose vouches make ``(fragment, round, state_hash)`` adoptable;
    empty when it is not (the rule is in the module docstring)."""
    said = _said(vouches, fragment, round, evidence)
    backing = frozenset(a for a, h in said.items() if h == state_hash)
    if evidence.creator is not None and evidence.creator in backing:
        return backing
    enough = len(backing) >= evidence.min_vouchers and 2 * len(backing) > len(said)
    return backing if enough else frozenset()


def vouched(
    vouches: Iterable[Vouch], fragment: int, round: int, state_hash: str, evidence: Evidence
) -> bool:
    """Whether ``(fragment, round, state_hash)`` is adoptable on ``evidence``."""
    return bool(vouchers(vouches, fragment, round, state_hash, evidence))


def schedule_offence(record: NodeRecord, schedule: Schedule) -> str | None:
    """Why ``record``'s claims break the schedule (end of the run, versions its step
    allows), or None when they do not."""
    step = record.global_step
    if step > schedule.steps:
        return f"global step {step} is beyond the run's end (step {schedule.steps})"
    for entry in record.fragments:
        if entry.fragment >= schedule.num_fragments:
            return f"fragment {entry.fragment} does not exist ({schedule.num_fragments} in the run)"
        allowed = schedule.last_round(step, entry.fragment)
        if entry.version > allowed:
            return (
                f"fragment {entry.fragment} at version {entry.version} is beyond round "
                f"{allowed}, the last its step {step} allows"
            )
    return None


@dataclass(frozen=True, slots=True)
class SwarmView:
    """What one check of the records and vouches may believe (``assess``)."""

    records: tuple[NodeRecord, ...]
    """The records (other nodes') whose claims fit the schedule, in the order read: the
    donors to choose from (their states still have to be adoptable)."""
    vouched: Mapping[Claim, frozenset[str]]
    """Adoptable states with the counting authors that vouched for them, and version 0 of
    each fragment with this node's initial hash (no vouchers)."""
    step: int | None
    """The robust step of the swarm, from the clock's records within the pace (None: none)."""
    pace: int | None = None
    """The pace the records' steps were bounded by (None: no clock record)."""
    offences: Mapping[str, str] = field(default_factory=dict)
    """Peer id -> what of its record is ignored, and why."""
    uncounted: Mapping[str, str] = field(default_factory=dict)
    """Author -> a state it vouches for that is not adoptable, its vouch not counting
    (a paper identity, or a newcomer this node has not worked with)."""

    def holds_vouched(self, record: NodeRecord, fragment: int) -> bool:
        """Whether ``record``'s state of ``fragment`` is adoptable (or the initial one)."""
        entry = record.fragment(fragment)
        return entry is not None and (fragment, entry.version, entry.state_hash) in self.vouched

    def vouched_by(self, record: NodeRecord, fragment: int) -> bool:
        """Whether ``record``'s author is a counting voucher of the state of ``fragment`` it
        holds (no Sybil that merely copies an adoptable claim)."""
        entry = record.fragment(fragment)
        if entry is None:
            return False
        claim = (fragment, entry.version, entry.state_hash)
        return record.peer_id in self.vouched.get(claim, frozenset())

    def newest_vouched(self, fragment: int) -> int:
        """The newest adoptable version of ``fragment`` (0: none)."""
        return max((k for p, k, _ in self.vouched if p == fragment), default=0)


def _in_run(vouches: Iterable[Vouch], schedule: Schedule) -> dict[tuple[int, int], list[Vouch]]:
    """Vouches by round, without those for rounds the run never sends."""
    by_round: dict[tuple[int, int], list[Vouch]] = defaultdict(list)
    for v in vouches:
        last = schedule.last_round(schedule.steps, v.fragment)
        if v.fragment < schedule.num_fragments and v.round <= last:
            by_round[(v.fragment, v.round)].append(v)
    return by_round


def vouched_claims(
    vouches: Sequence[Vouch],
    schedule: Schedule,
    initial_hashes: Sequence[str],
    evidence: Evidence,
) -> dict[Claim, frozenset[str]]:
    """Every adoptable state with its counting vouchers, and version 0 of each fragment at
    this node's initial hash (no vouchers). Vouches for rounds the run never sends are
    dropped."""
    claims: dict[Claim, frozenset[str]] = {
        (p, 0, h): frozenset() for p, h in enumerate(initial_hashes)
    }
    for (p, k), same in _in_run(vouches, schedule).items():
        for h in {v.state_hash for v in same}:
            if counted := vouchers(same, p, k, h, evidence):
                claims[(p, k, h)] = counted
    return claims


def uncounted_vouches(
    vouches: Sequence[Vouch], claims: Mapping[Claim, frozenset[str]], evidence: Evidence
) -> dict[str, str]:
    """Author -> why its vouch is refused, for authors outside ``evidence.voters()`` that
    vouch for a state ``claims`` does not hold (a vouch agreeing with the counted ones is
    no refusal: an honest newcomer's, usually)."""
    voters = evidence.voters()
    refused: dict[str, str] = {}
    for v in vouches:
        claim = (v.fragment, v.round, v.state_hash)
        if v.author not in voters and claim not in claims and v.author not in refused:
            refused[v.author] = (
                f"fragment {v.fragment} round {v.round} hash {v.state_hash[:16]}... is not "
                "adoptable on the word of peers this node has not seen work"
            )
    return refused


def assess(
    records: Sequence[NodeRecord],
    vouches: Sequence[Vouch],
    schedule: Schedule,
    initial_hashes: Sequence[str],
    evidence: Evidence,
) -> SwarmView:
    """Bound ``records`` (other nodes') by the schedule and the clock's pace, find the
    adoptable states in ``vouches`` and the robust step, all on ``evidence`` (rules in the
    module docstring)."""
    claims = vouched_claims(vouches, schedule, initial_hashes, evidence)
    offences: dict[str, str] = {}
    in_schedule = []
    for record in records:
        if why := schedule_offence(record, schedule):
            offences[record.peer_id] = f"record ignored: {why}"
        else:
            in_schedule.append(record)
    clock = evidence.clock()
    pace = _median_step(in_schedule, clock)
    paced = []
    for record in in_schedule:
        if pace is not None and record.global_step > pace + schedule.pace_slack:
            offences[record.peer_id] = (
                f"step not followed: global step {record.global_step} runs ahead of the "
                f"swarm's pace (step {pace} + {schedule.pace_slack})"
            )
        else:
            paced.append(record)
    step = _median_step(paced, clock)
    uncounted = uncounted_vouches(vouches, claims, evidence)
    return SwarmView(tuple(in_schedule), claims, step, pace, offences, uncounted)


def group_target(records: Iterable[NodeRecord], evidence: Evidence, min_group_size: int) -> int:
    """How many declarations of a round this node waits for before it leads
    (``Matchmaker.target_group_size``): itself and the records' authors of its clock (the
    peers it saw work and the creator; its anchors while it has seen nobody work), at least
    ``min_group_size``. A record alone is no node that will come: counting every record let
    paper keys make each round this node leads wait out its whole window. An honest node
    this node has not worked with yet is waited for only in the rounds open to every
    record's author (``Follower.wait_target``; docs/design.md "Evidence"). The run's creator
    before its first round with others has nobody to count but newcomers, so each of its
    rounds is open: leading its first round on the minimum, it formed it with the first
    joiner to declare, and the others' JOINs came after it (6 nodes at 200 ms); paper keys
    can stretch those rounds to the window, until its first round with others."""
    return target_for(counted_peers(records, evidence), min_group_size)


def target_for(counted: int, min_group_size: int) -> int:
    """The target of ``counted`` peers besides this node: all of them and itself, at least
    ``min_group_size``."""
    return max(min_group_size, counted + 1)


def counted_peers(records: Iterable[NodeRecord], evidence: Evidence) -> int:
    """The peers ``group_target`` counts besides this node, before its floor: the authors of
    ``records`` of its clock, or every author for the creator before it worked with anyone."""
    authors = {r.peer_id for r in records} - {evidence.me}
    if evidence.creator != evidence.me or evidence.workers:
        authors &= evidence.clock()
    return len(authors)


def creator_worked(vouches: Iterable[Vouch], creator: str | None) -> bool:
    """Whether the run's creator vouched for a round it shared with other members: from
    then on it has peers whose word it counts, and can heal from them (``creator_missing``)."""
    return any(v.author == creator and len(set(v.members) - {creator}) > 0 for v in vouches)


def creator_missing(
    members: Collection[str], me: str, creator: str | None, live: bool, worked: bool
) -> str | None:
    """Why this node should not apply a round of ``members`` (None: it may): the run's
    creator is ``live`` and not among them, and has not ``worked`` with anyone yet.

    The creator counts nobody's vouches until it has been in a round with them (it has no
    anchors), so a round its joiners apply without it leaves it at a state it can never
    heal from: at 6 nodes and 200 ms its first rounds failed on timing, the five joiners
    formed every round among themselves, and it trained alone to the end (docs/design.md
    "Healing and joining"). Refused by every member that is not the creator, such a round
    is failed by all of them alike, and their tokens carry over to the next, which may
    include it. A creator that left (no live record) holds nobody back."""
    if creator is None or me == creator or worked or not live or creator in members:
        return None
    return "the run's creator is not in it, and has not been in a round with others yet"


def _median_step(records: Sequence[NodeRecord], clock: frozenset[str]) -> int | None:
    """The lower median step of the records of ``clock`` (None: none of them)."""
    steps = [r.global_step for r in records if r.peer_id in clock]
    return median_low(steps) if steps else None


UNCOUNTED = "not counting the vouches of peer %s (no round with this node): %s"
"""How ``Offences`` logs a refused vouch: it names no offence (a newcomer's can be honest)."""


class Offences:
    """Peers caught making implausible claims or serving unadoptable states, each logged
    once with its peer id and ``template`` (records are read again at every check)."""

    def __init__(self, template: str = "peer %s: %s") -> None:
        self.template = template
        self.logged: set[str] = set()

    def report(self, peer: str, offence: str) -> None:
        if peer in self.logged:
            return
        if len(self.logged) >= MAX_OFFENDERS_LOGGED:
            self.logged.clear()
        self.logged.add(peer)
        logger.warning(self.template, peer, offence)

    def report_all(self, offences: Mapping[str, str]) -> None:
        for peer, offence in offences.items():
            self.report(peer, offence)
