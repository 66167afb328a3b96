"""The dashboard's view of a run, from hand-made records: merging, agreement, totals."""

from __future__ import annotations

import dataclasses

from diloco.node.dashboard.view import STALE_AFTER, SwarmView, agreement, reachability
from diloco.protocol.records.metrics import LossPoint, MetricsRecord, RoundEntry
from diloco.protocol.records.nodes import FragmentVersion, NodeRecord

A = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
B = "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"
C = "12D3KooWCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC"
H1, H2 = "11" * 32, "22" * 32


def _node(peer: str, step: int, frags: list[tuple[int, int, str]], tps: float = 10.0) -> NodeRecord:
    versions = tuple(FragmentVersion(*f) for f in frags)
    return NodeRecord(peer, ("/ip4/127.0.0.1/tcp/1",), step, versions, tps, "0.1.0")


def _metrics(
    steps: int = 10,
    losses: tuple[LossPoint, ...] = (),
    rounds: tuple[RoundEntry, ...] = (),
    sent: int = 0,
) -> MetricsRecord:
    return MetricsRecord(steps, steps * 64, 0.9, sent, sent, 0, 0, losses, (), rounds)


def test_fragment_hashes_marked_agree_majority_conflict_behind() -> None:
    view = SwarmView()
    view.update(
        [
            _node(A, 30, [(0, 3, H1), (1, 2, H1)]),
            _node(B, 30, [(0, 3, H1), (1, 2, H1)]),
            _node(C, 30, [(0, 3, H2), (1, 1, H2)]),
        ],
        {},
        now=100.0,
    )
    rows = view.view("fragments", 100.0)
    assert isinstance(rows, list)
    zero, one = rows
    assert (zero["newest_version"], zero["agreed"]) == (3, False)
    assert [c["mark"] for c in zero["cells"]] == ["majority", "majority", "conflict"]
    assert (one["newest_version"], one["agreed"]) == (2, True)
    assert [c["mark"] for c in one["cells"]] == ["agree", "agree", "behind"]


def test_agreement_tie_is_conflict_for_all() -> None:
    assert agreement([H1, H2]) == {H1: "conflict", H2: "conflict"}
    assert agreement([H1, H1]) == {H1: "agree"}


def test_rounds_merge_reports_of_all_members() -> None:
    view = SwarmView()
    a_rounds = (
        RoundEntry(0, 1, 31, 2, 0.5, 100, 110, True),
        RoundEntry(1, 1, 41, 2, 0.25, 50, 60, True),
        RoundEntry(2, 1, 51, 0, 0.0, 0, 0, False),
    )
    b_rounds = (
        RoundEntry(0, 1, 32, 2, 0.75, 200, 210, True),
        RoundEntry(1, 1, 42, 0, 0.0, 0, 0, False),
        RoundEntry(2, 1, 52, 0, 0.0, 0, 0, False),
    )
    records = [_node(A, 60, []), _node(B, 60, [])]
    view.update(records, {A: _metrics(rounds=a_rounds), B: _metrics(rounds=b_rounds)}, 10.0)
    rounds = view.view("rounds", 10.0)
    assert isinstance(rounds, list)
    assert [(r["fragment"], r["step"], r["outcome"]) for r in rounds] == [
        (0, 31, "ok"),
        (1, 41, "partial"),
        (2, 51, "failed"),
    ]
    assert (rounds[0]["bytes_sent"], rounds[0]["seconds"], rounds[0]["members"]) == (300, 0.75, 2)
    assert rounds[1]["failed_by"] == [B] and rounds[1]["reported_by"] == [A, B]
    totals = view.view("totals", 10.0)
    assert isinstance(totals, dict)
    assert (totals["rounds_ok"], totals["rounds_partial"], totals["rounds_failed"]) == (1, 1, 1)


def test_loss_history_outlives_the_records_window_and_is_bounded() -> None:
    view = SwarmView(max_points=5)
    view.update([_node(A, 10, [])], {A: _metrics(losses=(LossPoint(1, 5.0), LossPoint(2, 4.0)))}, 1)
    view.update([_node(A, 20, [])], {A: _metrics(losses=(LossPoint(3, 3.0),))}, 2)
    loss = view.view("loss", 2.0)
    assert loss == {
        "train": [{"peer_id": A, "points": [(1, 5.0), (2, 4.0), (3, 3.0)]}],
        "outer": [],
        "clock": [[10, 1.0], [20, 2.0]],
    }
    points = tuple(LossPoint(s, 1.0) for s in range(10, 20))
    view.update([_node(A, 30, [])], {A: _metrics(losses=points)}, 3)
    loss = view.view("loss", 3.0)
    assert isinstance(loss, dict)
    assert [s for s, _ in loss["train"][0]["points"]] == [15, 16, 17, 18, 19]


def test_peers_alive_last_seen_and_metrics_of_strangers() -> None:
    view = SwarmView()
    view.update([_node(A, 10, [(0, 1, H1)]), _node(B, 10, [(0, 1, H1)])], {C: _metrics()}, 100.0)
    view.update([_node(A, 10, [(0, 1, H1)]), _node(B, 12, [(0, 1, H1)])], {}, 104.0)
    now = 104.0 + STALE_AFTER + 1
    view.update([_node(B, 12, [(0, 1, H1)])], {}, now)
    peers = view.view("peers", now)
    assert isinstance(peers, list)
    assert [(p["peer_id"], p["alive"]) for p in peers] == [(A, False), (B, True)]
    assert peers[0]["last_seen_s"] == now - 100.0 and peers[1]["last_seen_s"] == now - 104.0
    fragments = view.view("fragments", now)
    assert isinstance(fragments, list)
    assert [c["peer_id"] for c in fragments[0]["cells"]] == [B]


def test_totals_against_data_parallel_by_hand() -> None:
    view = SwarmView()
    view.set_run("r-0123456789abcdef", {"name": "r", "outer": {"sync_every": 30}}, 1000)
    view.update(
        [_node(A, 10, [], tps=100.0), _node(B, 10, [], tps=50.0)],
        {A: _metrics(steps=10, sent=400), B: _metrics(steps=30, sent=600)},
        1.0,
    )
    totals = view.view("totals", 1.0)
    # bf16 gradients, M = 2 (ring factor 2(M-1)/M = 1): 1000 x 2 bytes per step and node.
    assert totals == {
        "peers_alive": 2,
        "peers_seen": 2,
        "global_step": 10,
        "tokens": 40 * 64,
        "tokens_per_s": 150.0,
        "bytes_sent": 1000,
        "bytes_received": 1000,
        "dp_bytes_estimate": 2000.0 * 40,
        "dp_ratio": 80.0,
        "rounds_ok": 0,
        "rounds_partial": 0,
        "rounds_failed": 0,
    }
    run = view.view("run", 1.0)
    assert isinstance(run, dict) and run["sync_every"] == 30 and run["num_params"] == 1000


def test_reachability_from_addresses() -> None:
    assert reachability([]) == "client"
    assert reachability(["/ip4/1.2.3.4/tcp/1/p2p/X/p2p-circuit"]) == "relay"
    assert reachability(["/ip4/1.2.3.4/tcp/1"]) == "direct"


def _run_view(steps: int = 600) -> SwarmView:
    view = SwarmView()
    view.set_run("seen-0123456789abcdef", {"name": "seen", "steps": steps}, None)
    return view


def test_progress_and_time_left_follow_the_swarms_pace() -> None:
    view = _run_view()
    view.update([_node(A, 100, []), _node(B, 90, [])], {}, now=1000.0)
    run = view.view("run", 1000.0)
    assert isinstance(run, dict)
    assert (run["global_step"], run["progress"], run["eta_s"]) == (100, 100 / 600, None)
    view.update([_node(A, 150, []), _node(B, 140, [])], {}, now=1010.0)  # 5 steps a second
    run = view.view("run", 1010.0)
    assert isinstance(run, dict)
    assert run["eta_s"] == (600 - 150) / 5.0
    assert run["state"] == "training"
    loss = view.view("loss", 1010.0)
    assert isinstance(loss, dict) and loss["clock"] == [[100, 1000.0], [150, 1010.0]]


def test_a_finished_run_shows_its_final_eval_and_no_peer_alive() -> None:
    """Both nodes left after the last step, their records still in the DHT for a while:
    none is counted alive, the run is finished, the final eval is their last one."""
    view = _run_view(steps=40)
    training = dataclasses.replace(_metrics(), evals=(LossPoint(30, 4.75),), device="cpu")
    view.update([_node(A, 30, []), _node(B, 30, [])], {A: training, B: training}, now=10.0)
    finals = {
        A: dataclasses.replace(training, evals=(LossPoint(30, 4.75), LossPoint(40, 4.5))),
        B: dataclasses.replace(training, evals=(LossPoint(30, 4.75), LossPoint(40, 4.25))),
    }
    for peer in (A, B):
        finals[peer] = dataclasses.replace(finals[peer], end="finished")
    view.update([_node(A, 40, []), _node(B, 40, [])], finals, now=12.0)
    state = view.state(13.0)
    assert state["totals"]["peers_alive"] == 0 and state["totals"]["peers_seen"] == 2
    assert state["run"]["state"] == "finished"
    assert state["run"]["final_eval"] == {"step": 40, "loss": 4.375, "peers": 2}
    assert (state["run"]["progress"], state["run"]["eta_s"]) == (1.0, 0.0)
    assert state["run"]["join_command"] is None
    assert [(p["state"], p["final_eval"]) for p in state["peers"]] == [
        ("finished", 4.5),
        ("finished", 4.25),
    ]


def test_a_stopped_peer_and_a_vanished_one_are_told_apart() -> None:
    view = _run_view()
    stopped = dataclasses.replace(_metrics(), end="stopped")
    view.update([_node(A, 30, []), _node(B, 30, [])], {A: stopped}, now=10.0)
    states = {p["peer_id"]: p["state"] for p in view.state(11.0)["peers"]}
    assert states == {A: "stopped", B: "training"}
    later = view.state(10.0 + STALE_AFTER + 1.0)
    assert {p["peer_id"]: p["state"] for p in later["peers"]} == {A: "stopped", B: "gone"}
    assert later["run"]["state"] == "stopped" and later["run"]["final_eval"] is None


def test_peers_show_a_short_name_and_how_they_train() -> None:
    view = _run_view()
    labelled = dataclasses.replace(_metrics(), device="cuda:0", precision="bf16", batch_size=16)
    view.update([_node(A, 30, [])], {A: labelled}, now=10.0)
    (row,) = view.state(10.0)["peers"]
    assert row["name"] == A[-8:] and len(row["name"]) == 8
    assert (row["device"], row["precision"], row["batch_size"]) == ("cuda:0", "bf16", 16)


def test_the_join_command_names_a_directly_reachable_live_peer() -> None:
    view = _run_view()
    relayed = NodeRecord(B, (f"/ip4/5.6.7.8/tcp/1/p2p/R/p2p-circuit/p2p/{B}",), 5, (), 1.0, "0")
    direct = NodeRecord(A, (f"/ip4/1.2.3.4/tcp/31337/p2p/{A}",), 5, (), 1.0, "0")
    view.update([relayed], {}, now=10.0)
    first = view.state(10.0)["run"]["join_command"]
    assert first == f"diloco-node join --initial-peers /ip4/5.6.7.8/tcp/1/p2p/R/p2p-circuit/p2p/{B}"
    view.update([relayed, direct], {}, now=11.0)
    command = view.state(11.0)["run"]["join_command"]
    assert command == f"diloco-node join --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/{A}"
