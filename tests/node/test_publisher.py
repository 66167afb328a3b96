"""A node's records stay in the DHT while it heals slowly (docs/design.md "The node and its
CLI": the publisher has a thread of its own, healing an executor of its own).

One ``SwarmNode`` trains in this process with a real DHT; it joined through a donor (a
``Swarm`` of the test's, also real) that publishes a newer vouched state of fragment 0 and
serves it only after three record lifetimes. While the node's heal waits for it, the
node's record is read back again and again: it must never have expired.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import diloco.node.swarm.publisher
from diloco import __version__
from diloco.node.config import NodeOptions, RoundOptions, RunConfig
from diloco.node.model.fragments import send_step
from diloco.node.swarm.node import SwarmNode
from diloco.node.swarm.pinned_run import start_run
from diloco.node.training.inner import InnerConfig
from diloco.node.training.outer_config import OuterConfig
from diloco.protocol.records.nodes import FragmentVersion, NodeRecord, Vouch, publish_vouches
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.state.fragment import FragmentState, OuterState
from diloco.protocol.swarm import Swarm, make_dht

pytestmark = pytest.mark.swarm

TTL = 2.0
"""The node's record lifetime in this test (30 s in a real node; shorter keeps it short)."""
SLOW = 3 * TTL
"""Seconds the donor takes to answer: the heal lasts three record lifetimes."""


def test_records_never_expire_while_a_heal_waits_for_a_slow_donor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(diloco.node.swarm.publisher, "RECORD_TTL", TTL)
    monkeypatch.setattr(diloco.node.swarm.publisher, "PUBLISH_EVERY", TTL / 4)
    donor_dht = make_dht(NetworkOptions())
    donor_id = donor_dht.peer_id.to_base58()
    anchor = f"{donor_dht.get_visible_maddrs()[0]}"
    run = RunConfig(
        steps=100_000,
        seq_len=16,
        outer=OuterConfig(sync_every=6),
        inner=InnerConfig(warmup_steps=5),
        codec="none",
    )
    net = NetworkOptions(initial_peers=(anchor,))
    run, signed, dht = start_run(run, net, None)
    options = NodeOptions(batch_size=2, eval_batches=1, threads=1, log_every=10_000)
    rounds = RoundOptions(matchmaking_window=0.3, round_timeout=1.0)
    events: list[dict[str, Any]] = []
    node = SwarmNode(run, options, rounds, net, signed=signed, dht=dht, on_event=events.append)
    me = node.swarm.peer_id.to_base58()
    donor = Swarm(node.run_id, dht=donor_dht)
    training = threading.Thread(target=node.train)
    try:
        # The donor holds round 2 of fragment 0 (vouched by itself, the node's anchor),
        # and the node's initial state of every other fragment.
        states = {p: s.clone() for p, s in enumerate(node.trainer.sync.states)}
        zero = states[0]
        states[0] = FragmentState(torch.full_like(zero.outer, 0.25), zero.momentum.clone(), 2)
        step = send_step(0, 2, run.outer.sync_every, len(states))
        asked, answered = threading.Event(), threading.Event()

        def slowly() -> OuterState:
            asked.set()
            time.sleep(SLOW)
            answered.set()
            return OuterState(step, states)

        donor.serve_state(slowly)
        entries = tuple(FragmentVersion(p, s.version, s.sha256()) for p, s in states.items())
        record = NodeRecord(donor_id, tuple(donor.maddrs), step, entries, 0.0, __version__)
        donor.publish_record(record, ttl=300)
        vouch = Vouch(donor_id, 0, 2, states[0].sha256(), (donor_id,))
        donor.call(publish_vouches(donor.dht, node.run_id, [vouch], 300))

        training.start()
        assert asked.wait(60), "the node never asked the donor for fragment 0"
        seen = []  # whether the node's record was there, at each read during the heal
        while not answered.is_set():
            seen.append(any(r.peer_id == me for r in donor.read_records()))
            time.sleep(0.2)
        deadline = time.monotonic() + 30
        while not any(e["event"] == "healed" for e in events) and time.monotonic() < deadline:
            time.sleep(0.1)
        healed = [e["fragments"] for e in events if e["event"] == "healed"]
        assert healed[:1] == [[0]], "the slow donor's state was not adopted"
        assert len(seen) >= 2 and all(seen), seen
    finally:
        node.stop_event.set()
        if training.is_alive():
            training.join(60)
        node.close()
        donor.shutdown()
