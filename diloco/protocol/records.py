"""Per-node DHT records (SPEC 4): who is in the run, how far it is, what state it holds.

Layout in the DHT (all keys namespaced by the run id, all values with expiration)::

    key "{run_id}/nodes"        subkey = peer id (base58)   value = NodeRecord.to_wire()
    key "diloco-runs/{name}"    subkey = run id             value = True

The second key lets a node whose configuration differs (same name, other hash) say so
clearly instead of silently waiting alone. Records come from untrusted peers: ``from_wire``
validates them strictly and rejects rather than coerces (hivemind's ``SchemaValidator``
spirit); ``read_records`` skips and logs invalid ones. Nothing here is signed: a peer can
write another peer's subkey, so records are hints (donor lists, status), never proof.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from diloco.errors import ProtocolError
from diloco.protocol.run_id import check_run_id, run_name

logger = logging.getLogger(__name__)

RECORD_SCHEMA = 1
MAX_ADDRS = 16
MAX_ADDR_CHARS = 256
MAX_FRAGMENTS = 4096
MAX_VERSION_CHARS = 64
HASH_PATTERN = re.compile(r"^[0-9a-f]{64}$")
PEER_ID_PATTERN = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{30,64}$")  # base58 multihash


@dataclass(frozen=True, slots=True)
class FragmentVersion:
    """State of one fragment on one node: ``version`` is the round ``k`` of the last applied
    round (0 before any), ``state_hash`` the hex sha256 of its outer params and momentum."""

    fragment: int
    version: int
    state_hash: str


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a node publishes about itself (SPEC 4 "DHT records").

    ``throughput`` is in tokens per second; ``global_step`` counts inner steps.
    """

    peer_id: str
    addrs: tuple[str, ...]
    global_step: int
    fragments: tuple[FragmentVersion, ...]
    throughput: float
    software_version: str

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

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able value stored under the node's subkey."""
        self.check()
        return {
            "v": RECORD_SCHEMA,
            "addrs": list(self.addrs),
            "step": self.global_step,
            "frags": [[f.fragment, f.version, f.state_hash] for f in self.fragments],
            "tps": self.throughput,
            "sw": self.software_version,
        }

    @classmethod
    def from_wire(cls, peer_id: str, value: object) -> NodeRecord:
        """Parse and check an untrusted DHT value.

        Raises:
            ProtocolError: for any deviation from the schema (extra or missing keys too).
        """
        _require(isinstance(value, Mapping), f"record of type {type(value).__name__}")
        assert isinstance(value, Mapping)
        _require(set(value) == {"v", "addrs", "step", "frags", "tps", "sw"}, "record keys")
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
        )
        record.check()
        return record

    def fragment(self, index: int) -> FragmentVersion | None:
        """This node's entry for fragment ``index``, if it published one."""
        return next((f for f in self.fragments if f.fragment == index), None)


def nodes_key(run_id: str) -> str:
    """DHT key under which every node of the run publishes its record."""
    return f"{check_run_id(run_id)}/nodes"


def runs_key(run_id: str) -> str:
    """DHT key listing the run ids that share this run's human name."""
    return f"diloco-runs/{run_name(run_id)}"


async def publish_record(dht: DHT, run_id: str, record: NodeRecord, ttl: float) -> bool:
    """Store ``record`` for ``ttl`` seconds and refresh the run-name marker.

    Returns whether the record was stored. The marker's result is ignored: every node of
    the run writes the same subkey, and the DHT refuses a write that does not extend the
    expiration another node already set.
    """
    expiration = get_dht_time() + ttl
    stored = await dht.store(
        nodes_key(run_id), record.to_wire(), expiration, subkey=record.peer_id, return_future=True
    )
    await dht.store(runs_key(run_id), True, expiration, subkey=run_id, return_future=True)
    return bool(stored)


async def read_records(dht: DHT, run_id: str) -> list[NodeRecord]:
    """Every valid, unexpired record of the run, sorted by peer id; invalid ones are logged."""
    found = await dht.get(nodes_key(run_id), latest=True, return_future=True)
    if found is None or not isinstance(found.value, Mapping):
        return []
    records = []
    for peer_id, item in found.value.items():
        try:
            records.append(NodeRecord.from_wire(str(peer_id), getattr(item, "value", None)))
        except ProtocolError as exc:
            logger.warning("ignoring invalid record from %s: %s", peer_id, exc)
    return sorted(records, key=lambda r: r.peer_id)


async def other_run_ids(dht: DHT, run_id: str) -> list[str]:
    """Run ids with this run's name but another configuration hash, seen in the DHT.

    A node that finds no peers of its own run but some here should tell the user that its
    configuration differs from theirs.
    """
    found = await dht.get(runs_key(run_id), latest=True, return_future=True)
    if found is None or not isinstance(found.value, Mapping):
        return []
    return sorted(str(other) for other in found.value if other != run_id)


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
    state hash differs (SPEC 4: "compares the state hash the others publish").

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


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise ProtocolError(f"invalid node record: {what}")
