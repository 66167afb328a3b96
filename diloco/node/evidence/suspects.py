"""Which fragments a node keeps in doubt after a round it may have missed (pure functions
of its versions, the schedule and the swarm's records, used by ``diloco.node.swarm.healing``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from diloco.node.evidence.claims import Schedule, SwarmView
from diloco.node.model.fragments import last_sent_round, send_step
from diloco.protocol.records.nodes import NodeRecord


def version_of(record: NodeRecord, fragment: int) -> int:
    """The version ``record`` claims for ``fragment`` (-1: none published)."""
    entry = record.fragment(fragment)
    return entry.version if entry else -1


def missed_rounds(step: int, versions: Sequence[int], sync_every: int) -> dict[int, int]:
    """Fragment -> the last round sent by ``step``, for fragments whose version is older
    (a state downloaded while that round was in flight lacks its result)."""
    num_fragments = len(versions)
    missed = {}
    for p, version in enumerate(versions):
        k = last_sent_round(step, p, sync_every, num_fragments)
        if k >= 1 and version < k:
            missed[p] = k
    return missed


def failed_everywhere(
    view: SwarmView, missed: Mapping[int, int], schedule: Schedule, tau: int
) -> bool:
    """Whether every round of ``missed`` (fragment -> round) failed for every peer that holds
    a vouched state of its fragment: each such record is past the round's receive step (the
    run's ``tau``) with an older version. Nobody will vouch for such a round, so a joiner
    need not wait for it to settle. Unvouched claims (a Sybil's newer one) say nothing; no
    vouched holder at all: nothing is known."""
    for p, k in missed.items():
        holders = [r for r in view.records if view.holds_vouched(r, p)]
        receive = schedule.send_step(p, k) + tau
        if not holders or any(version_of(r, p) >= k or r.global_step <= receive for r in holders):
            return False
    return True


def open_suspects(
    suspects: Mapping[int, int], versions: Sequence[int], step: int, sync_every: int
) -> dict[int, int]:
    """The suspects (fragment -> round that failed) still in doubt: the version has not
    caught up with that round (peers publish theirs every few seconds) and the fragment's
    next round is not sent yet (that round tells anew)."""
    num_fragments = len(versions)
    return {
        p: k
        for p, k in suspects.items()
        if versions[p] < k and step < send_step(p, k + 1, sync_every, num_fragments)
    }
