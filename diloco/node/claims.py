"""What healing and joining may believe of other nodes' claims (SPEC 4 "State transfer", 4.1).

A node record is a claim (its author signed it, nothing more): "I am at step s, I hold
fragment p at version k with hash h". One hostile peer could claim the run's last step or
versions a thousand rounds ahead and serve zeros (issue 11, attack 1), or publish under many
identities to crowd the honest donors out (attack 6). Two rules, pure functions of the
records and vouches read in one check, bound what such claims can make a node do:

**Claims bounded by the schedule** (``schedule_offence``, ``assess``). A record is
*plausible* iff

- its global step is at most the run's end ``T`` (``RunConfig.steps``);
- every fragment version is at most ``last_sent_round(step, p)``: an honest node applies
  round ``k`` of ``p`` at its receive step, never before the send step of ``k``, and when
  it adopts a peer's newer vouched state it moves on to that round's send step at least
  (``healing.catch_up_step``), so its records keep this bound too;
- its global step is at most the swarm's *pace* plus ``PACE_SLACK_ROUNDS * H``. The pace
  is the lower median of the steps of the records that pass the two rules above and whose
  authors vouched for a vouched round (members of rounds a majority signed). While no
  such record exists (before the first vouched round, or after every member left), it is
  the lower median of the node's *anchors*, the peers its user gave it to join through
  (``--initial-peers``: a joiner follows the run of the peer it was given), and for a node
  without anchors (the run's first) of all those records. Records that never took part in
  a round (Sybils) do not move it, nor does one member among several (with two, the lower
  median is the lower step). Every fragment syncs once per ``H`` steps and rounds hold
  members within about ``tau`` steps of each other, so ``2H`` leaves honest nodes room.
  Not the newest vouched round: a node whose rounds fail (its partners left or lag) trains
  on without producing vouches, and must stay believable. Known limit: a member that runs
  more than ``2H`` ahead of the median of the others is ignored as a donor (and logged
  once) until they catch up; before any round is vouched, Sybil records can move the
  first node's pace (so it uses no pace for its own step, below).

A record that breaks the schedule is ignored altogether. A record whose step runs ahead
of the pace is not followed (the robust step leaves it out), but it stays a donor of what
it holds: a state is taken only when vouched and hashed anyway (below), so an honest node
that ran ahead can still heal the others. ``Offences`` logs each offender once, with its
peer id, the rule it broke and what is ignored.

**Vouched states** (``vouched``). After applying round ``(p, k)`` each member publishes a
signed vouch: (``k``, its outer hash after applying, the round's sorted members). A state
``(p, k, h)`` is *vouched* iff the vouches for exactly ``(p, k, h)`` that sign one and the
same member list ``L``, from authors in ``L``, number a strict majority of ``L`` and at
least ``MIN_VOUCHERS``, or when the run's creator (``RunConfig.creator``, who signed the
configuration every joiner follows) is one of the members and vouches for it. Vouches
signing another list for the same state do not count for
``L`` (so members that disagree on who took part vouch for nothing), and do not veto it
either (one member could otherwise make every state of its rounds unusable). Version 0
needs no vouch: it must be the node's own initial state (same seed), compared by hash.

Bounds and limits of the vouch rule: one peer (or any minority of a round's members),
unless it is the run's creator, cannot make a state vouched, whatever it claims; a hash a
majority of the members did not reach is never adopted. A round of one member
(``min_group_size`` 1) has no majority of two: only the creator's lone rounds are vouched
(by its own vouch), so a joiner can join a creator that trained alone, not another lone
node. With two members both must vouch (or the creator): one can withhold its vouch and
keep joiners off that round's state (they wait for the next round). A vouch outlives its
author by its lifetime (a node publishes its vouches to live 5 minutes: a fact about the
past stays true), so the members left can still heal a node that missed the round; a state
whose round's majority left longer ago is no longer vouched. Several identities of one
person that form a round's majority, or a round of their own, can vouch: in an open swarm
they are several peers (SPEC 4.1); a closed swarm bounds them.

**Robust step**: a lagging node skips ahead, and a joiner starts, at the pace (the lower
median above) computed over the plausible records only; never at one donor's claim. A node
without anchors has no robust step until a round is vouched: the run's first node is the
swarm's clock then, and Sybil records claiming steps ahead would make it skip ahead again
and again (records are free; rounds are not).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median_low

from diloco.node.fragments import last_sent_round, send_step
from diloco.protocol.records.nodes import NodeRecord, Vouch

logger = logging.getLogger(__name__)

MIN_VOUCHERS = 2
"""Vouches a state needs at the least (a strict majority of one member is that member)."""
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


def vouchers(
    vouches: Iterable[Vouch],
    fragment: int,
    round: int,
    state_hash: str,
    creator: str | None = None,
) -> frozenset[str]:
    """The members whose vouches make ``(fragment, round, state_hash)`` vouched; empty when
    it is not vouched (the rule is in the module docstring). With several member lists that
    each reach a majority (a round split into two groups that reached one state), the
    largest set of vouchers. Without a majority, the vouch of the run's ``creator`` (a
    member of the round) is enough: a joiner follows the creator's run anyway."""
    by_members: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for v in vouches:
        same = (v.fragment, v.round, v.state_hash) == (fragment, round, state_hash)
        if same and v.author in v.members:
            by_members[v.members].add(v.author)
    counted: frozenset[str] = frozenset()
    for members, authors in by_members.items():
        majority = len(authors) >= MIN_VOUCHERS and 2 * len(authors) > len(members)
        if majority and len(authors) > len(counted):
            counted = frozenset(authors)
    if not counted and any(creator in authors for authors in by_members.values()):
        counted = frozenset({creator}) if creator is not None else counted
    return counted


def vouched(
    vouches: Iterable[Vouch],
    fragment: int,
    round: int,
    state_hash: str,
    creator: str | None = None,
) -> bool:
    """Whether a majority of round ``(fragment, round)``'s members (or the run's
    ``creator``, one of them) vouch for ``state_hash``."""
    return bool(vouchers(vouches, fragment, round, state_hash, creator))


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
    donors to choose from (their states still have to be vouched)."""
    vouched: Mapping[Claim, frozenset[str]]
    """Vouched states with the members that vouched for them, and version 0 of each
    fragment with this node's initial hash (no vouchers)."""
    step: int | None
    """The robust step of the swarm, from the records within the pace (None: nobody's)."""
    pace: int | None = None
    """The pace the records' steps were bounded by (None: no record passed the schedule)."""
    offences: Mapping[str, str] = field(default_factory=dict)
    """Peer id -> what of its record is ignored, and why."""

    def holds_vouched(self, record: NodeRecord, fragment: int) -> bool:
        """Whether ``record``'s state of ``fragment`` is vouched (or the initial one)."""
        entry = record.fragment(fragment)
        return entry is not None and (fragment, entry.version, entry.state_hash) in self.vouched

    def vouched_by(self, record: NodeRecord, fragment: int) -> bool:
        """Whether ``record``'s author vouched for the state of ``fragment`` it holds: a
        member of the round that made it (no Sybil that merely copies a vouched claim)."""
        entry = record.fragment(fragment)
        if entry is None:
            return False
        claim = (fragment, entry.version, entry.state_hash)
        return record.peer_id in self.vouched.get(claim, frozenset())

    def newest_vouched(self, fragment: int) -> int:
        """The newest vouched version of ``fragment`` (0: none)."""
        return max((k for p, k, _ in self.vouched if p == fragment), default=0)


def vouched_claims(
    vouches: Sequence[Vouch],
    schedule: Schedule,
    initial_hashes: Sequence[str],
    creator: str | None = None,
) -> dict[Claim, frozenset[str]]:
    """Every vouched state with its vouchers, and version 0 of each fragment at this node's
    initial hash (no vouchers). Vouches for rounds that the run never sends are dropped."""
    claims: dict[Claim, frozenset[str]] = {
        (p, 0, h): frozenset() for p, h in enumerate(initial_hashes)
    }
    by_claim: dict[Claim, list[Vouch]] = defaultdict(list)
    for v in vouches:
        if v.fragment < schedule.num_fragments and v.round <= schedule.last_round(
            schedule.steps, v.fragment
        ):
            by_claim[(v.fragment, v.round, v.state_hash)].append(v)
    for claim, same in by_claim.items():
        if counted := vouchers(same, *claim, creator=creator):
            claims[claim] = counted
    return claims


def assess(
    records: Sequence[NodeRecord],
    vouches: Sequence[Vouch],
    schedule: Schedule,
    initial_hashes: Sequence[str],
    anchors: frozenset[str] = frozenset(),
    creator: str | None = None,
) -> SwarmView:
    """Bound ``records`` (other nodes') by the schedule and the swarm's pace, find the
    vouched states in ``vouches`` and the robust step (rules in the module docstring).
    ``anchors`` are the peer ids this node joined through, ``creator`` the run's."""
    claims = vouched_claims(vouches, schedule, initial_hashes, creator)
    counted = frozenset().union(*claims.values())
    offences: dict[str, str] = {}
    in_schedule = []
    for record in records:
        if why := schedule_offence(record, schedule):
            offences[record.peer_id] = f"record ignored: {why}"
        else:
            in_schedule.append(record)
    pace = _median_step(in_schedule, counted, anchors, anyone=True)
    paced = []
    for record in in_schedule:
        if pace is not None and record.global_step > pace + schedule.pace_slack:
            offences[record.peer_id] = (
                f"step not followed: global step {record.global_step} runs ahead of the "
                f"swarm's pace (step {pace} + {schedule.pace_slack})"
            )
        else:
            paced.append(record)
    step = _median_step(paced, counted, anchors, anyone=bool(anchors))
    return SwarmView(tuple(in_schedule), claims, step, pace, offences)


def _median_step(
    records: Sequence[NodeRecord], vouchers: frozenset[str], anchors: frozenset[str], anyone: bool
) -> int | None:
    """The lower median step of the records of ``vouchers``; without any, of ``anchors``;
    without any, of all ``records`` if ``anyone`` (None when it comes to nobody)."""
    for group in (vouchers, anchors):
        if steps := [r.global_step for r in records if r.peer_id in group]:
            return median_low(steps)
    steps = [r.global_step for r in records] if anyone else []
    return median_low(steps) if steps else None


class Offences:
    """Peers caught making implausible claims or serving unvouched states, each logged once
    with its peer id and offence (records are read again at every check)."""

    def __init__(self) -> None:
        self.logged: set[str] = set()

    def report(self, peer: str, offence: str) -> None:
        if peer in self.logged:
            return
        if len(self.logged) >= MAX_OFFENDERS_LOGGED:
            self.logged.clear()
        self.logged.add(peer)
        logger.warning("peer %s: %s", peer, offence)

    def report_all(self, offences: Mapping[str, str]) -> None:
        for peer, offence in offences.items():
            self.report(peer, offence)
