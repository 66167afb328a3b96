"""Per-node DHT records (docs/design.md "The round"): who is in the run, how far it is, what state
it holds.

Layout in the DHT (all keys namespaced by the run id, all values with expiration; every
value is a signed envelope of ``signed_records``, subkey = the author's peer id)::

    key "{run_id}/nodes"                subkey = author   payload = NodeRecord.to_wire()
    key "{run_id}/frag{p}/round{k}"     subkey = author   payload = [weight (float > 0),
                                                          proof or b"" (closed swarm),
                                                          client (bool), prior (16 hex)]
                                                          (forms: ``declarations``)
    key "{run_id}/vouch/frag{p}"        subkey = author   payload = vouch_payload(rounds)
    key "{run_id}/metrics"              subkey = author   payload = ``metrics_records``

The second key is the matchmaking declaration of round ``(p, k)`` (a client reduces no
part; the prior is the start of the hash of the fragment state the member starts the round
from: only equal priors share a group, ``matchmaking``); the third holds a member's
vouches: the last rounds of fragment ``p`` it applied, each with the outer state hash it
reached and the round's members (docs/design.md "Threat model": healing adopts only a state a
majority of its round vouches for). Records are owned: only the author's key can write its subkey,
so a record says what its author claims, nothing more (healing must still check claims:
``diloco.node.evidence.claims``).
Payloads come from untrusted peers: ``from_wire`` validates them strictly and rejects
rather than coerces (hivemind's ``SchemaValidator`` spirit); readers skip and log invalid
ones. ``record_validator`` gives every DHT node these schemas (and discovery's).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from diloco.errors import ProtocolError
from diloco.protocol.records import metrics as metrics_records
from diloco.protocol.records import run_configs as discovery
from diloco.protocol.records.declarations import parse_declaration
from diloco.protocol.trust.envelopes import (
    SignedRecordValidator,
    SignedValue,
    pack_payload,
    read_signed,
    read_signed_many,
    signer,
    store_signed,
    unpack_payload,
)
from diloco.protocol.wire.run_id import RUN_ID_PATTERN, check_run_id

logger = logging.getLogger(__name__)

RECORD_SCHEMA = 1
MAX_ADDRS = 16
MAX_ADDR_CHARS = 256
MAX_FRAGMENTS = 4096
MAX_VERSION_CHARS = 64
MAX_STEP_SECONDS = 86400.0
"""Most seconds a record may claim for one full-batch inner step (a day)."""
_RECORD_KEYS = {"v", "addrs", "step", "frags", "tps", "sw"}
HASH_PATTERN = re.compile(r"^[0-9a-f]{64}$")
PEER_ID_PATTERN = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{30,64}$")  # base58 multihash
MAX_NODE_RECORD_BYTES = 64 * 1024
MAX_VOUCH_ROUNDS = 3
"""Rounds per vouch record: a member's last applied rounds of one fragment."""
MAX_ROUND_MEMBERS = 256
"""Members of one round (``wire.MAX_GROUP_SIZE``): 3 rounds of 256 peer ids fit 48 KiB."""
MAX_VOUCH_BYTES = 60 * 1024
VOUCH_SCHEMA = 1

_RUN_ID = RUN_ID_PATTERN.pattern.strip("^$")
NODES_KEY_PATTERN = re.compile(rf"{_RUN_ID}/nodes")
ROUND_KEY_PATTERN = re.compile(rf"{_RUN_ID}/frag[0-9]{{1,9}}/round[0-9]{{1,12}}")
VOUCH_KEY_PATTERN = re.compile(rf"{_RUN_ID}/vouch/frag([0-9]{{1,9}})")
"""Forms of the keys above (``lobby.round_key`` builds the last), matched in full."""


@dataclass(frozen=True, slots=True)
class FragmentVersion:
    """State of one fragment on one node: ``version`` is the round ``k`` of the last applied
    round (0 before any), ``state_hash`` the hex sha256 of its outer params and momentum."""

    fragment: int
    version: int
    state_hash: str


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a node publishes about itself (docs/design.md "Wire formats").

    ``throughput`` is in tokens per second; ``global_step`` counts inner steps;
    ``step_seconds`` is the node's estimate of one inner step with its full batch (None: not
    measured yet), from which the nodes agree on a pace (``diloco.node.training.pace``: counted only
    from peers seen working, docs/design.md "Pace"). ``left``: the node left the run (its last
    record, replacing its regular one: readers stop counting it at once instead of when its
    regular record expires, docs/design.md "Wire formats"). ``done``: the node trained the
    run's last step and applied its last rounds: the versions it publishes are final, so a
    node that lacks a last round stops waiting for it to vouch (docs/design.md "The run's
    end").
    """

    peer_id: str
    addrs: tuple[str, ...]
    global_step: int
    fragments: tuple[FragmentVersion, ...]
    throughput: float
    software_version: str
    step_seconds: float | None = None
    left: bool = False
    done: bool = False

    def check(self) -> None:
        """Raise ProtocolError unless every field is in range.

        Raises:
            ProtocolError: naming the first bad field.
        """
        _require(PEER_ID_PATTERN.match(self.peer_id) is not None, f"peer id {self.peer_id!r}")
        _require(len(self.addrs) <= MAX_ADDRS, f"{len(self.addrs)} addresses")
        for addr in self.addrs:
            _require(isinstance(addr, str) and 0 < len(addr) <= MAX_ADDR_CHARS, f"addr {addr!r}")
        _require(_is_int(self.global_step) and self.global_step >= 0, "global step")
        _require(len(self.fragments) <= MAX_FRAGMENTS, f"{len(self.fragments)} fragments")
        seen: set[int] = set()
        for frag in self.fragments:
            _require(_is_int(frag.fragment) and frag.fragment >= 0, f"fragment {frag.fragment!r}")
            _require(frag.fragment not in seen, f"fragment {frag.fragment} twice")
            seen.add(frag.fragment)
            _require(_is_int(frag.version) and frag.version >= 0, f"version {frag.version!r}")
            _require(
                isinstance(frag.state_hash, str)
                and HASH_PATTERN.match(frag.state_hash) is not None,
                f"state hash {frag.state_hash!r}",
            )
        _require(
            isinstance(self.throughput, float)
            and math.isfinite(self.throughput)
            and self.throughput >= 0,
            f"throughput {self.throughput!r}",
        )
        _require(
            isinstance(self.software_version, str)
            and 0 < len(self.software_version) <= MAX_VERSION_CHARS,
            f"software version {self.software_version!r}",
        )
        seconds = self.step_seconds
        _require(
            seconds is None
            or (
                isinstance(seconds, float)
                and math.isfinite(seconds)
                and 0 < seconds <= MAX_STEP_SECONDS
            ),
            f"step seconds {seconds!r}",
        )
        _require(isinstance(self.left, bool), f"left flag {self.left!r}")
        _require(isinstance(self.done, bool), f"done flag {self.done!r}")

    def as_left(self) -> NodeRecord:
        """This record marked as its node's last: the node left the run."""
        return replace(self, left=True)

    def as_done(self) -> NodeRecord:
        """This record marked final: its node is done with the run's steps and rounds."""
        return replace(self, done=True)

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able value stored under the node's subkey (``sps`` only when the
        step seconds are known, ``left`` only when the node left, ``done`` only when it is
        done)."""
        self.check()
        wire = {
            "v": RECORD_SCHEMA,
            "addrs": list(self.addrs),
            "step": self.global_step,
            "frags": [[f.fragment, f.version, f.state_hash] for f in self.fragments],
            "tps": self.throughput,
            "sw": self.software_version,
        }
        if self.step_seconds is not None:
            wire["sps"] = self.step_seconds
        if self.left:
            wire["left"] = True
        if self.done:
            wire["done"] = True
        return wire

    @classmethod
    def from_wire(cls, peer_id: str, value: object) -> NodeRecord:
        """Parse and check an untrusted DHT value.

        Raises:
            ProtocolError: for any deviation from the schema (extra or missing keys too).
        """
        _require(isinstance(value, Mapping), f"record of type {type(value).__name__}")
        assert isinstance(value, Mapping)
        _require(set(value) - {"sps", "left", "done"} == _RECORD_KEYS, "record keys")
        _require(value["v"] == RECORD_SCHEMA, f"record schema {value['v']!r}")
        addrs, frags = value["addrs"], value["frags"]
        _require(isinstance(addrs, list | tuple), "addrs type")
        _require(isinstance(frags, list | tuple) and len(frags) <= MAX_FRAGMENTS, "frags type")
        fragments = []
        for item in frags:
            _require(isinstance(item, list | tuple) and len(item) == 3, f"fragment entry {item!r}")
            fragments.append(FragmentVersion(item[0], item[1], item[2]))
        record = cls(
            peer_id=peer_id,
            addrs=tuple(addrs),
            global_step=value["step"],
            fragments=tuple(fragments),
            throughput=value["tps"],
            software_version=value["sw"],
            step_seconds=value.get("sps"),
            left=value.get("left", False),
            done=value.get("done", False),
        )
        record.check()
        return record

    @classmethod
    def from_payload(cls, peer_id: str, payload: bytes) -> NodeRecord:
        """Parse a signed record's payload (msgpack of ``to_wire``).

        Raises:
            ProtocolError: oversize, undecodable, or failing ``from_wire``.
        """
        return cls.from_wire(peer_id, unpack_payload(payload, MAX_NODE_RECORD_BYTES))

    def fragment(self, index: int) -> FragmentVersion | None:
        """This node's entry for fragment ``index``, if it published one."""
        return next((f for f in self.fragments if f.fragment == index), None)


def nodes_key(run_id: str) -> str:
    """DHT key under which every node of the run publishes its record."""
    return f"{check_run_id(run_id)}/nodes"


async def publish_record(dht: DHT, run_id: str, record: NodeRecord, ttl: float) -> bool:
    """Store ``record`` (signed by this node) for ``ttl`` seconds; returns whether it was
    stored.

    Raises:
        ValueError: ``record`` is another peer's (its peer id is not the DHT's identity).
    """
    if record.peer_id != (author := signer(dht).peer_id):
        raise ValueError(f"cannot publish the record of {record.peer_id} as {author}")
    payload = pack_payload(record.to_wire())
    return await store_signed(dht, nodes_key(run_id), payload, get_dht_time() + ttl)


async def read_records(dht: DHT, run_id: str) -> list[NodeRecord]:
    """Every valid, unexpired, correctly signed record of the run of a node still in it,
    sorted by peer id (``read_run_records``, without the nodes that left)."""
    return (await read_run_records(dht, run_id)).live


@dataclass(frozen=True, slots=True)
class RunRecords:
    """The run's node records as read: those of the nodes in it, and who left."""

    live: list[NodeRecord]
    """Sorted by peer id."""
    left: frozenset[str]
    """Peer ids whose last record says they left the run."""


async def read_run_records(dht: DHT, run_id: str) -> RunRecords:
    """Every valid, unexpired, correctly signed record of the run; invalid ones are logged
    with the peer id they claim. A node whose record says it left is not among the live:
    matchmaking targets, healing donors and ``status`` stop counting it at once, and rounds
    stop waiting for its declarations (docs/design.md "Wire formats")."""
    return _run_records(await read_signed(dht, nodes_key(run_id)))


async def read_records_and_vouches(
    dht: DHT, run_id: str, fragments: Sequence[int]
) -> tuple[RunRecords, list[Vouch]]:
    """``read_run_records`` and ``read_vouches`` of ``fragments``, in one DHT call."""
    keys = [vouch_key(run_id, p) for p in fragments]
    found = await read_signed_many(dht, [nodes_key(run_id), *keys])
    vouches = [v for key in keys for v in _vouches(key, found[key])]
    return _run_records(found[nodes_key(run_id)]), vouches


def _run_records(found: Mapping[str, SignedValue]) -> RunRecords:
    records, left = [], set()
    for peer_id, signed in found.items():
        try:
            record = NodeRecord.from_payload(peer_id, signed.payload)
        except ProtocolError as exc:
            logger.warning("ignoring invalid record from %s: %s", peer_id, exc)
            continue
        if record.left:
            logger.debug("%s left the run", peer_id)
            left.add(peer_id)
        else:
            records.append(record)
    return RunRecords(sorted(records, key=lambda r: r.peer_id), frozenset(left))


@dataclass(frozen=True, slots=True)
class Vouch:
    """``author``'s signed word that applying round ``round`` of ``fragment`` left its outer
    state with hash ``state_hash``, in a round whose full contributors were ``members``
    (sorted peer ids, the author among them). Evidence only together with the vouches of
    a majority of ``members`` (``diloco.node.evidence.claims.vouched``)."""

    author: str
    fragment: int
    round: int
    state_hash: str
    members: tuple[str, ...]

    def check(self) -> None:
        """Raise ProtocolError unless every field is in range.

        Raises:
            ProtocolError: naming the first bad field.
        """
        _vouch(PEER_ID_PATTERN.match(self.author) is not None, f"peer id {self.author!r}")
        _vouch(_is_int(self.fragment) and self.fragment >= 0, f"fragment {self.fragment!r}")
        _vouch(_is_int(self.round) and self.round >= 1, f"vouched round {self.round!r}")
        _vouch(
            isinstance(self.state_hash, str) and HASH_PATTERN.match(self.state_hash) is not None,
            f"state hash {self.state_hash!r}",
        )
        members = self.members
        _vouch(0 < len(members) <= MAX_ROUND_MEMBERS, f"{len(members)} members")
        for peer in members:
            _vouch(isinstance(peer, str) and PEER_ID_PATTERN.match(peer) is not None, "member")
        _vouch(list(members) == sorted(set(members)), "members not sorted and distinct")
        _vouch(self.author in members, "a vouch from outside the round's members")


def vouch_key(run_id: str, fragment: int) -> str:
    """DHT key under which the members of fragment ``fragment``'s rounds vouch."""
    return f"{check_run_id(run_id)}/vouch/frag{fragment}"


def vouch_payload(vouches: Sequence[Vouch]) -> bytes:
    """The payload of one author's vouches for one fragment (``parse_vouches`` reads it)."""
    _vouch(0 < len(vouches) <= MAX_VOUCH_ROUNDS, f"{len(vouches)} vouched rounds")
    for vouch in vouches:
        vouch.check()
    rounds = [[v.round, v.state_hash, list(v.members)] for v in vouches]
    return pack_payload({"v": VOUCH_SCHEMA, "rounds": rounds})


def parse_vouches(key: str, author: str, payload: bytes) -> list[Vouch]:
    """The vouches in ``author``'s record under the vouch key ``key``.

    Raises:
        ProtocolError: not a vouch key, oversize or malformed payload, a round twice, or a
            vouch failing ``Vouch.check``.
    """
    match = VOUCH_KEY_PATTERN.fullmatch(key)
    _vouch(match is not None, f"vouch key {key!r}")
    assert match is not None
    value = unpack_payload(payload, MAX_VOUCH_BYTES)
    _vouch(isinstance(value, Mapping) and set(value) == {"v", "rounds"}, "vouch record keys")
    assert isinstance(value, Mapping)
    _vouch(value["v"] == VOUCH_SCHEMA, f"vouch schema {value['v']!r}")
    rounds = value["rounds"]
    _vouch(isinstance(rounds, list) and 0 < len(rounds) <= MAX_VOUCH_ROUNDS, "vouch rounds")
    vouches = []
    for item in rounds:
        _vouch(isinstance(item, list) and len(item) == 3, f"vouch entry {item!r:.80}")
        _vouch(isinstance(item[2], list), "vouch members type")
        vouch = Vouch(author, int(match.group(1)), item[0], item[1], tuple(item[2]))
        vouch.check()
        vouches.append(vouch)
    _vouch(len({v.round for v in vouches}) == len(vouches), "a round vouched twice")
    return vouches


async def publish_vouches(dht: DHT, run_id: str, vouches: Sequence[Vouch], ttl: float) -> bool:
    """Store this node's ``vouches`` of one fragment (its last applied rounds) for ``ttl`` s.

    Raises:
        ValueError: vouches of another author, or of several fragments.
    """
    author = signer(dht).peer_id
    if {(v.author, v.fragment) for v in vouches} != {(author, vouches[0].fragment)}:
        raise ValueError(f"{author} vouches only for itself and one fragment at a time")
    key = vouch_key(run_id, vouches[0].fragment)
    return await store_signed(dht, key, vouch_payload(vouches), get_dht_time() + ttl)


async def read_vouches(dht: DHT, run_id: str, fragments: Sequence[int]) -> list[Vouch]:
    """Every valid, correctly signed vouch for each of ``fragments`` (one DHT call); invalid
    records are logged with the peer id they claim and skipped."""
    keys = [vouch_key(run_id, p) for p in fragments]
    found = await read_signed_many(dht, keys)
    return [v for key in keys for v in _vouches(key, found[key])]


def _vouches(key: str, found: Mapping[str, SignedValue]) -> list[Vouch]:
    vouches = []
    for peer_id, signed in found.items():
        try:
            vouches.extend(parse_vouches(key, peer_id, signed.payload))
        except ProtocolError as exc:
            logger.warning("ignoring vouches of %s under %s: %s", peer_id, key, exc)
    return vouches


def record_validator() -> SignedRecordValidator:
    """The DHT validator of every record kind the protocol writes (``make_dht`` installs it)."""
    return SignedRecordValidator(
        [
            (NODES_KEY_PATTERN, _check_node_record),
            (ROUND_KEY_PATTERN, _check_declaration),
            (VOUCH_KEY_PATTERN, parse_vouches),
            (discovery.RUN_CONFIGS_KEY_PATTERN, discovery.check_config_payload),
            (metrics_records.METRICS_KEY_PATTERN, metrics_records.check_metrics_payload),
        ]
    )


def _check_node_record(key: str, author: str, payload: bytes) -> None:
    NodeRecord.from_payload(author, payload)


def _check_declaration(key: str, author: str, payload: bytes) -> None:
    parse_declaration(payload)


def newest_donors(records: Sequence[NodeRecord], fragments: Sequence[int]) -> list[NodeRecord]:
    """Records holding the newest version of every fragment in ``fragments``, best first.

    Ordering: highest summed version, then highest global step, then peer id, so that
    donors tried in turn go from the most to the least up to date.
    """

    def versions(record: NodeRecord) -> list[int] | None:
        entries = [record.fragment(p) for p in fragments]
        if any(e is None for e in entries):
            return None
        return [e.version for e in entries if e is not None]

    candidates = [(r, v) for r in records if (v := versions(r)) is not None]
    candidates.sort(key=lambda rv: (-sum(rv[1]), -rv[0].global_step, rv[0].peer_id))
    return [r for r, _ in candidates]


def divergent_peers(
    records: Sequence[NodeRecord], fragment: int, version: int, state_hash: str
) -> tuple[list[NodeRecord], list[NodeRecord]]:
    """Peers ahead of this node on ``fragment``, and peers at the same version whose outer
    state hash differs (docs/design.md "The round": "compares the state hash the others publish").

    A node that finds either list non-empty after a round it could not be sure of heals by
    fetching that fragment from a peer of the first list (or, for a conflict, from the
    majority hash's holders).
    """
    ahead, conflicting = [], []
    for record in records:
        entry = record.fragment(fragment)
        if entry is None:
            continue
        if entry.version > version:
            ahead.append(record)
        elif entry.version == version and entry.state_hash != state_hash:
            conflicting.append(record)
    return ahead, conflicting


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(condition: bool, what: str, kind: str = "node record") -> None:
    if not condition:
        raise ProtocolError(f"invalid {kind}: {what}")


def _vouch(condition: bool, what: str) -> None:
    _require(condition, what, "vouch")
