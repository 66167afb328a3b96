"""Issue 11, attack 2, with real peer processes: a reducer that returns -30 times the mean.

The liar is honest everywhere else: it sends its contributions, answers checks truthfully,
and sends the same signed bytes to every member, so the REPORT digests agree. Defence: the
members' sampled checks (``verification``) find the lie, a dispute convicts the reducer,
no honest member applies the round, and every honest member reports the liar.
"""

from __future__ import annotations

import pytest
from faults import Fault
from swarm_expected import group_order, in_process_sha
from swarm_peers import TIMEOUTS, PeerProcess, command, run_rounds

pytestmark = pytest.mark.swarm


def test_lying_reducer_part_reaches_no_honest_result_and_the_liar_is_named(
    honest: list[PeerProcess], fragment: int
) -> None:
    ids = [p.peer_id for p in honest]
    liar = group_order(ids)[1]  # reduces part 1
    others = [i for i in range(4) if i != liar]
    command(honest[liar : liar + 1], "fault", Fault.LYING_REDUCER.value)
    seeds, weights, numel = [fragment * 10 + i for i in range(4)], [1.0, 2.0, 1.0, 1.0], 50_000
    specs = [[(fragment, 1, numel, seeds[i], weights[i])] for i in range(4)]
    results = [r[0] for r in run_rounds(honest, specs, timeout=TIMEOUTS.total + 60)]
    for i in others:
        assert not results[i]["ok"], results[i]
        assert results[i]["reason"].startswith(f"reducer {ids[liar]} of part 1 lied: block "), (
            results
        )
    assert results[liar]["ok"]  # found nothing wrong with the honest parts: it applies its lie
    for i in others:
        honest[i].send("offences")
        kind, offences = honest[i].recv(30)
        assert kind == "offences" and [who for who, _ in offences] == [ids[liar]], offences
    # the honest peers go on: the next round, without the lie, succeeds for everyone
    command(honest[liar : liar + 1], "fault", Fault.NONE.value)
    specs = [[(fragment, 2, numel, seeds[i], weights[i])] for i in range(4)]
    results = [r[0] for r in run_rounds(honest, specs, timeout=TIMEOUTS.total + 60)]
    assert {r.get("sha256") for r in results} == {
        in_process_sha(ids, numel, seeds, weights, "none")
    }
