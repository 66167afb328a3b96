"""DHT record schema: strict validation of untrusted values, donor ranking."""

from __future__ import annotations

import pytest

from diloco.errors import ProtocolError
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.lobby import round_key
from diloco.protocol.records.declarations import parse_declaration
from diloco.protocol.records.nodes import (
    MAX_NODE_RECORD_BYTES,
    MAX_ROUND_MEMBERS,
    MAX_VOUCH_ROUNDS,
    NODES_KEY_PATTERN,
    ROUND_KEY_PATTERN,
    VOUCH_KEY_PATTERN,
    FragmentVersion,
    NodeRecord,
    Vouch,
    divergent_peers,
    newest_donors,
    nodes_key,
    parse_vouches,
    vouch_key,
    vouch_payload,
)
from diloco.protocol.trust.envelopes import pack_payload

PEER = "12D3KooWLrRGEqt4uZwLBrUdd4763UK5hmFfmv15Eu8CATkuN8CM"
H = "ab" * 32


def _record(peer: str = PEER, step: int = 10, versions: tuple[int, ...] = (1, 2)) -> NodeRecord:
    frags = tuple(FragmentVersion(p, v, H) for p, v in enumerate(versions))
    return NodeRecord(peer, ("/ip4/127.0.0.1/tcp/1",), step, frags, 12.5, "0.1.0")


def test_record_round_trip() -> None:
    record = _record()
    assert NodeRecord.from_wire(PEER, record.to_wire()) == record


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"extra": 1}, "keys"),
        ({"v": 2}, "schema"),
        ({"step": -1}, "global step"),
        ({"step": True}, "global step"),
        ({"tps": float("nan")}, "throughput"),
        ({"tps": 3}, "throughput"),
        ({"frags": [[0, 1, "xyz"]]}, "state hash"),
        ({"frags": [[0, 1, H], [0, 2, H]]}, "twice"),
        ({"frags": [[0, 1]]}, "fragment entry"),
        ({"addrs": ["a" * 300]}, "addr"),
        ({"sw": ""}, "software"),
        ({"sps": 0.0}, "step seconds"),
        ({"sps": -1.0}, "step seconds"),
        ({"sps": float("inf")}, "step seconds"),
        ({"sps": 1e6}, "step seconds"),
        ({"sps": 2}, "step seconds"),
        ({"sps": "fast"}, "step seconds"),
        ({"left": 1}, "left flag"),
        ({"left": "yes"}, "left flag"),
        ({"left": None}, "left flag"),
        ({"done": 1}, "done flag"),
        ({"done": "yes"}, "done flag"),
    ],
)
def test_record_invalid_field_rejected(change: dict[str, object], match: str) -> None:
    value = {**_record().to_wire(), **change}
    with pytest.raises(ProtocolError, match=match):
        NodeRecord.from_wire(PEER, value)


def test_record_step_seconds_round_trip_and_absent_when_unknown() -> None:
    record = NodeRecord(PEER, (), 3, (), 1.0, "0.1.0", step_seconds=0.25)
    assert record.to_wire()["sps"] == 0.25
    assert NodeRecord.from_wire(PEER, record.to_wire()) == record
    assert "sps" not in _record().to_wire()
    assert NodeRecord.from_wire(PEER, _record().to_wire()).step_seconds is None


def test_left_record_round_trip_and_regular_wire_form_unchanged() -> None:
    left = _record().as_left()
    assert left.to_wire() == {**_record().to_wire(), "left": True}
    assert NodeRecord.from_wire(PEER, left.to_wire()) == left
    assert set(_record().to_wire()) == {"v", "addrs", "step", "frags", "tps", "sw"}
    assert NodeRecord.from_wire(PEER, _record().to_wire()).left is False


def test_done_record_round_trip_and_left_after_done_keeps_both() -> None:
    done = _record().as_done()
    assert done.to_wire() == {**_record().to_wire(), "done": True}
    assert NodeRecord.from_wire(PEER, done.to_wire()) == done
    assert NodeRecord.from_wire(PEER, _record().to_wire()).done is False
    both = NodeRecord.from_wire(PEER, done.as_left().to_wire())
    assert both.done and both.left


def test_record_non_mapping_and_bad_peer_rejected() -> None:
    with pytest.raises(ProtocolError):
        NodeRecord.from_wire(PEER, [1, 2])
    with pytest.raises(ProtocolError, match="peer id"):
        NodeRecord.from_wire("not a peer id!", _record().to_wire())


def test_newest_donors_ranks_by_version_then_step() -> None:
    a = _record("12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", 5, (3, 3))
    b = _record("12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB", 9, (3, 3))
    c = _record("12D3KooWCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC", 50, (1, 3))
    d = _record("12D3KooWDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDD", 99, (7,))
    assert newest_donors([a, b, c, d], [0, 1]) == [b, a, c]
    assert newest_donors([a, b, c, d], [1]) == [c, b, a]


def test_keys_namespaced_by_run() -> None:
    run = "demo-0123456789abcdef"
    assert nodes_key(run) == "demo-0123456789abcdef/nodes"


def test_divergent_peers_finds_ahead_and_conflicting() -> None:
    same = _record("12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", 5, (3,))
    ahead = _record("12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB", 5, (4,))
    other = NodeRecord(
        "12D3KooWCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC",
        (),
        5,
        (FragmentVersion(0, 3, "cd" * 32),),
        1.0,
        "0.1.0",
    )
    assert divergent_peers([same, ahead, other], 0, 3, H) == ([ahead], [other])


def test_record_payload_round_trip_and_bounds() -> None:
    record = _record()
    assert NodeRecord.from_payload(PEER, pack_payload(record.to_wire())) == record
    with pytest.raises(ProtocolError, match="larger than"):
        NodeRecord.from_payload(PEER, bytes(MAX_NODE_RECORD_BYTES + 1))
    with pytest.raises(ProtocolError, match="invalid msgpack"):
        NodeRecord.from_payload(PEER, b"\x91" * 2000 + b"\xc0")  # deeper than msgpack allows


def test_key_forms_match_the_keys_built() -> None:
    run = "demo-0123456789abcdef"
    assert NODES_KEY_PATTERN.fullmatch(nodes_key(run))
    assert ROUND_KEY_PATTERN.fullmatch(round_key(run, RoundKey(12, 345)))
    for other in ("demo/nodes", "demo-0123456789abcdef/nodes/x", "demo-0123456789abcdef/frag1"):
        assert not any(p.fullmatch(other) for p in (NODES_KEY_PATTERN, ROUND_KEY_PATTERN))


@pytest.mark.parametrize("weight", [0.0, -1.0, float("inf"), float("nan"), 3, True, "1.0", None])
def test_declaration_weight_must_be_finite_positive_float(weight: object) -> None:
    with pytest.raises(ProtocolError, match="declared weight"):
        parse_declaration(pack_payload(weight))


def test_declaration_weight_accepted_with_or_without_proof() -> None:
    assert parse_declaration(pack_payload(0.25)) == (0.25, None, False, "")
    assert parse_declaration(pack_payload([0.25, b"p" * 32])) == (0.25, b"p" * 32, False, "")


def test_declaration_of_a_client_with_or_without_proof() -> None:
    assert parse_declaration(pack_payload([0.5, b"", True])) == (0.5, None, True, "")
    assert parse_declaration(pack_payload([0.5, b"p" * 32, True])) == (0.5, b"p" * 32, True, "")


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([0.25, b"p" * 31], "proof of 31 bytes"),
        ([0.25, b"p" * 33], "proof of 33 bytes"),
        ([float("nan"), b"p" * 32], "declared weight"),
        ([0.25, "p" * 32], "declared weight"),
        ([0.25, b"p" * 32, 1], "client flag"),
        ([0.25, b"p" * 32, False], "client flag"),
        ([0.25, b"p" * 5, True], "proof of 5 bytes"),
    ],
)
def test_declaration_with_a_malformed_proof_refused(value: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_declaration(pack_payload(value))


# -- vouches -----------------------------------------------------------------------------------

RUN = "demo-0123456789abcdef"
OTHER = "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"
MEMBERS = tuple(sorted([PEER, OTHER]))


def _vouch(round: int = 3, members: tuple[str, ...] = MEMBERS) -> Vouch:
    return Vouch(PEER, 2, round, H, members)


def test_vouches_round_trip_under_their_fragments_key() -> None:
    vouches = [_vouch(3), _vouch(4)]
    assert vouch_key(RUN, 2) == "demo-0123456789abcdef/vouch/frag2"
    assert VOUCH_KEY_PATTERN.fullmatch(vouch_key(RUN, 2))
    assert parse_vouches(vouch_key(RUN, 2), PEER, vouch_payload(vouches)) == vouches
    # The fragment comes from the (signed) key: the same payload under fragment 5 vouches
    # for fragment 5, never for 2.
    assert {v.fragment for v in parse_vouches(vouch_key(RUN, 5), PEER, vouch_payload(vouches))} == {
        5
    }


@pytest.mark.parametrize(
    ("rounds", "match"),
    [
        ([[3, H, list(MEMBERS)], [3, H, list(MEMBERS)]], "a round vouched twice"),
        ([[0, H, list(MEMBERS)]], "vouched round 0"),
        ([[True, H, list(MEMBERS)]], "vouched round True"),
        ([[3, "xyz", list(MEMBERS)]], "state hash"),
        ([[3, H, list(reversed(MEMBERS))]], "not sorted"),
        ([[3, H, [PEER, PEER]]], "not sorted"),
        ([[3, H, [OTHER]]], "outside the round's members"),
        ([[3, H, []]], "0 members"),
        ([[3, H, ["not a peer id!"]]], "member"),
        ([[3, H, list(MEMBERS)]] * (MAX_VOUCH_ROUNDS + 1), "vouch rounds"),
        ([[3, H]], "vouch entry"),
        ([], "vouch rounds"),
    ],
)
def test_vouch_payload_rejected(rounds: list[object], match: str) -> None:
    payload = pack_payload({"v": 1, "rounds": rounds})
    with pytest.raises(ProtocolError, match=match):
        parse_vouches(vouch_key(RUN, 0), PEER, payload)


def test_vouch_payload_schema_and_key_rejected() -> None:
    good = vouch_payload([_vouch()])
    with pytest.raises(ProtocolError, match="vouch key"):
        parse_vouches(nodes_key(RUN), PEER, good)
    with pytest.raises(ProtocolError, match="vouch record keys"):
        parse_vouches(vouch_key(RUN, 0), PEER, pack_payload({"v": 1, "rounds": [], "x": 1}))
    with pytest.raises(ProtocolError, match="vouch schema"):
        parse_vouches(vouch_key(RUN, 0), PEER, pack_payload({"v": 2, "rounds": []}))
    others = [f"12D3KooW{i:044d}".replace("0", "z") for i in range(MAX_ROUND_MEMBERS)]
    with pytest.raises(ProtocolError, match=f"{MAX_ROUND_MEMBERS + 1} members"):
        vouch_payload([_vouch(members=tuple(sorted([*others, PEER])))])
