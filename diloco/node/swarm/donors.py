"""Whom a heal fetches which fragment from, and what it adopts (docs/design.md "Healing
and joining"): pure functions of the node's ``SwarmView`` (what it may believe of the run's
records and vouches: ``diloco.node.evidence.claims``) and of its own versions, tested on
hand-made inputs; ``healing.Healer`` runs them.

- ``choose_donors``: whom to fetch a fragment from (peers whose vouched state is ahead of
  ours; else the holders of the majority vouched hash at our version, when ours is not it);
- ``join_donors``: whom a joiner fetches the whole state from;
- ``heal_plan``: which fragments to fetch, and from whom (``fetch_groups``: in as few
  requests as the donors allow);
- ``fragments_to_adopt``: which fetched fragments replace ours;
- ``catch_up_step``: the step a node moves to with what it adopted;
- ``ahead_of``: whether peers whose word counts are past this node's step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence

from diloco.node.evidence.claims import SwarmView
from diloco.node.evidence.suspects import version_of
from diloco.node.model.fragments import next_send_step, send_step
from diloco.protocol.records.nodes import NodeRecord, divergent_peers
from diloco.protocol.state.fragment import FragmentState

MAX_LAG_STEPS = 2
"""A node further behind the swarm's robust step than this skips ahead to it."""

Mine = Mapping[int, tuple[int, str]]
"""This node's fragments: fragment -> (version, state hash)."""


def hash_of(record: NodeRecord, fragment: int) -> str:
    entry = record.fragment(fragment)
    return entry.state_hash if entry else ""


def majority_hash(
    records: Sequence[NodeRecord], fragment: int, version: int, state_hash: str
) -> str:
    """The state hash most nodes hold at ``version``, counting this node's ``state_hash``.

    A tie goes to the smaller hash, so that every node of a split picks the same side.
    """
    counts = Counter([state_hash])
    counts.update(hash_of(r, fragment) for r in records if version_of(r, fragment) == version)
    return min(counts.items(), key=lambda item: (-item[1], item[0]))[0]


def lagging(view: SwarmView, my_step: int, max_lag: int = MAX_LAG_STEPS) -> bool:
    """Whether this node is more than ``max_lag`` steps behind the swarm's robust step.

    A node that lags by more misses every round (its peers leave the matchmaking window
    before it arrives), so it skips ahead to that step.
    """
    return view.step is not None and view.step > my_step + max_lag


def ahead_of(records: Iterable[NodeRecord], clock: Collection[str], my_step: int) -> bool:
    """Whether a record of ``clock`` (the peers whose word sets the pace: no stranger's
    claim) is more than ``MAX_LAG_STEPS`` past ``my_step``. Records are up to a publishing
    interval old, so such a peer is further ahead still: this node is behind it."""
    return any(r.global_step > my_step + MAX_LAG_STEPS for r in records if r.peer_id in clock)


def choose_donors(
    view: SwarmView, fragment: int, version: int, state_hash: str
) -> list[NodeRecord]:
    """Peers to fetch ``fragment`` from, best first; empty when ours is in line.

    Only records within the schedule whose state of ``fragment`` is adoptable count: a
    version or hash a peer merely claims, or that only identities this node never saw work
    vouch for, is not evidence (docs/design.md "Evidence"). ``version`` and ``state_hash``
    are ours. In order: peers with a newer version (newest first); else, when the majority
    at our version holds another state, its holders.
    """
    candidates = [r for r in view.records if view.holds_vouched(r, fragment)]
    ahead, conflicting = divergent_peers(candidates, fragment, version, state_hash)
    donors = []
    if ahead:
        donors = ahead
    elif conflicting:
        best = majority_hash(candidates, fragment, version, state_hash)
        if best != state_hash:
            donors = [r for r in conflicting if hash_of(r, fragment) == best]
    # Newest first; at one version the members that vouched for the state come first, so
    # that Sybils copying a vouched claim cannot crowd the round's own members out.
    return sorted(
        donors, key=lambda r: (-version_of(r, fragment), not view.vouched_by(r, fragment))
    )


def join_donors(view: SwarmView, num_fragments: int) -> list[NodeRecord]:
    """Peers a joiner fetches every fragment from: records within the schedule whose state
    of every fragment is vouched, the most up to date first."""
    fragments = range(num_fragments)
    vouched = [r for r in view.records if all(view.holds_vouched(r, p) for p in fragments)]

    def rank(record: NodeRecord) -> tuple[int, int, str]:
        # Highest summed version first; then the members that vouched for more of the
        # states they hold (Sybils copying vouched claims vouched for none). Not the
        # claimed step: anyone can claim one.
        newest = sum(version_of(record, p) for p in fragments)
        standing = sum(view.vouched_by(record, p) for p in fragments)
        return -newest, -standing, record.peer_id

    return sorted(vouched, key=rank)


def beyond_initial(
    view: SwarmView, fragments: Sequence[int], initial_hashes: Sequence[str]
) -> list[int]:
    """The ``fragments`` that some record holds past the run's initial state.

    A fragment that every record still holds at version 0 under this node's initial hash
    (no round of it has been applied yet) is the state this node built itself from the
    run's seed: downloading it would bring the same bytes again, at the run's start several
    megabytes per joiner from the creator's upload, seconds over a home line while the
    swarm trains on. A record claiming more (honest or not) keeps the fragment in the
    download, which then brings whatever state is vouched.
    """
    return [
        p
        for p in fragments
        if any(version_of(r, p) > 0 or hash_of(r, p) != initial_hashes[p] for r in view.records)
    ]


def heal_plan(
    view: SwarmView, mine: Mine, my_step: int, fragments: Sequence[int]
) -> dict[int, list[NodeRecord]]:
    """Fragment -> donors, for the ``fragments`` checked that are out of line; a node that
    lags the swarm checks all of ``mine`` (it skips ahead to the robust step)."""
    if lagging(view, my_step):
        fragments = sorted(mine)
    plan = {}
    for p in fragments:
        version, state_hash = mine[p]
        if donors := choose_donors(view, p, version, state_hash):
            plan[p] = donors
    return plan


def fragments_to_adopt(
    fetched: Mapping[int, FragmentState], mine: Mine, in_flight: Collection[int]
) -> list[int]:
    """Fetched fragments that replace ours (``mine``): newer, or at our version with another
    hash (``choose_donors`` fetched it from the majority).

    A fragment with a round in flight is left for a later check: that round's result is
    about to change it anyway.
    """
    adopted = []
    for p, theirs in sorted(fetched.items()):
        version, state_hash = mine[p]
        newer = theirs.version > version
        conflict = theirs.version == version and theirs.sha256() != state_hash
        if p not in in_flight and (newer or conflict):
            adopted.append(p)
    return adopted


def catch_up_step(
    states: Mapping[int, FragmentState], step: int, sync_every: int, num_fragments: int
) -> int:
    """The step a node moves to when it adopts ``states``: ``step``, or the send step of the
    newest adopted round if that is later. A vouched state is evidence that peers whose word
    counts got there; and a node's record must not claim a version beyond
    what its step allows (``claims.schedule_offence``)."""
    sends = [
        send_step(p, s.version, sync_every, num_fragments) for p, s in states.items() if s.version
    ]
    return max([step, *sends])


def skip_target(step: int, robust: int, sync_every: int, num_fragments: int) -> int:
    """Where a node behind the swarm's ``robust`` step skips to from ``step``: the robust
    step, or the step before the first send step it would skip, if the swarm is at most
    ``MAX_LAG_STEPS`` past that send. That round is still forming (its leader waits a join
    timeout for the peers it saw, and this node announced it), so the node trains the send
    step and takes part. Skipping it left the node out of the round, to heal afterwards: at 6
    nodes and 200 ms, joiners a few steps behind their creator skipped from 117 to 120 and
    from 137 to 141, onto or past the send steps of rounds they had announced."""
    first = min(
        next_send_step(step + 1, p, sync_every, num_fragments) for p in range(num_fragments)
    )
    if first <= robust and robust - first <= MAX_LAG_STEPS:
        return first - 1
    return robust
