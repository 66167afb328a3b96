"""A heal's downloads, one request per donor (docs/design.md "Healing and joining").

A donor answers a few state requests per peer, then one every few seconds
(``diloco.protocol.trust.limits``: a cap against peers that would keep it streaming). A
heal that asked for each fragment alone spent a request per fragment: a node that skipped
ahead a few times (a restarted joiner on a loaded machine, healing every fragment each time)
used up its donors' budget and was then refused (BUSY) for the rest of the run, never in
line again. So the fragments whose best donor is the same peer go in one request to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from diloco.protocol.records.nodes import NodeRecord


def by_donor(plan: Mapping[int, Sequence[NodeRecord]]) -> list[tuple[list[int], list[str]]]:
    """The requests of a heal plan (fragment -> its donors, best first): each the
    fragments sharing one best donor, with that donor first and then the other donors
    all of them share, in the first fragment's order."""
    requests = []
    left = sorted(p for p, donors in plan.items() if donors)
    while left:
        best = plan[left[0]][0].peer_id
        group = [p for p in left if plan[p][0].peer_id == best]
        holders = [{r.peer_id for r in plan[p]} for p in group]
        donors = [r.peer_id for r in plan[left[0]] if all(r.peer_id in h for h in holders)]
        requests.append((group, donors))
        left = [p for p in left if p not in group]
    return requests
