"""Who may influence a node: key holders of a closed swarm, and the peers its creator admitted
(docs/design.md "Closed swarms and admission").

A swarm key is one shared secret: anyone it leaked to is a member. Admission names the
members instead: ``start --admit FILE`` puts the peer ids of a file (one per line, ``#``
comments) in the run configuration, which the creator signs and whose hash is in the run
id, so every node of the run holds the same list and nobody can change it. The creator is
always admitted. A node enforces both rules in the two places a peer reaches it:

* DHT records (``Membership``, used by ``envelopes.read_signed`` for every record kind):
  records of peers not admitted, or without a valid ``record_proof`` in a closed swarm, are
  dropped, each author logged once.
* streams (``AdmittedTransport``, under ``swarm_key.ClosedTransport``): handlers refuse
  streams from peers not admitted (libp2p authenticates the peer id) with REJECT
  NOT_MEMBER before anything else, and the node opens no stream to such a peer.

A node whose own identity is not admitted refuses to join (``check_admitted``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from diloco.errors import ConfigError, ProtocolError
from diloco.protocol.runtime.streams import (
    StreamHandler,
    StreamTransport,
    close_after_peer,
    send_reject,
)
from diloco.protocol.trust.identity import public_key_of
from diloco.protocol.trust.swarm_key import NOT_MEMBER, ClosedSwarm, NotMember, short_name
from diloco.protocol.wire.frames import Reject, RejectCode

logger = logging.getLogger(__name__)

MAX_ADMITTED = 512
"""Most peer ids a run admits: 512 ids of ~52 characters fit the 64 KiB configuration."""
MAX_ADMIT_FILE_BYTES = 256 * 1024
NOT_ADMITTED = "not admitted to this run"
MAX_LOGGED = 4096
"""Peers whose refusal is remembered (logged once); beyond, refusals are no longer logged."""
REFUSAL_TIMEOUT = 10.0
"""Seconds a refused stream is held for the peer to read its REJECT."""


def read_admitted(path: str | Path) -> tuple[str, ...]:
    """The peer ids in the file at ``path``: one per line, ``#`` starts a comment, blank lines
    are skipped; sorted and without repeats (the form a run configuration holds).

    Raises:
        ConfigError: unreadable, a line that is not an Ed25519 peer id (naming the line),
            no peer id at all, or more than ``MAX_ADMITTED``.
    """
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_ADMIT_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read admission file {path}: {exc.strerror}") from exc
    if len(data) > MAX_ADMIT_FILE_BYTES:
        raise ConfigError(f"admission file {path} is larger than {MAX_ADMIT_FILE_BYTES} bytes")
    peers = set()
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        peer = line.split("#", 1)[0].strip()
        if peer:
            try:
                check_peer_ids([peer])
            except ConfigError as exc:
                raise ConfigError(f"admission file {path}, line {number}: {exc}") from exc
            peers.add(peer)
    if not peers:
        raise ConfigError(f"admission file {path} names no peer id")
    admitted = tuple(sorted(peers))
    check_peer_ids(admitted)
    return admitted


def check_peer_ids(peers: Collection[str]) -> None:
    """Raise unless ``peers`` are at most ``MAX_ADMITTED`` Ed25519 peer ids.

    Raises:
        ConfigError: naming the first bad one; the fix is in the message.
    """
    if len(peers) > MAX_ADMITTED:
        raise ConfigError(f"a run admits at most {MAX_ADMITTED} peer ids, not {len(peers)}")
    for peer in peers:
        try:
            public_key_of(peer)
        except ProtocolError as exc:
            raise ConfigError(
                f"{peer!r:.80} is not a peer id ({exc}); `diloco-node keygen --identity FILE` "
                "prints the peer id of an identity file"
            ) from exc


def check_admitted(run_id: str, admitted: Collection[str] | None, me: str) -> None:
    """Refuse to take part in run ``run_id`` when this node (peer id ``me``) is not admitted.

    Raises:
        ConfigError: one line naming this node's peer id and the fix.
    """
    if admitted is not None and me not in admitted:
        raise ConfigError(
            f"this node (peer {me}) is not admitted to run {run_id}: ask its creator to "
            "admit your peer id, and start with the --identity file it belongs to"
        )


class Membership:
    """Which records a node takes into account: in a ``closed`` swarm, those whose envelope
    carries a valid ``record_proof``; with an ``admitted`` set, those of its peers only.
    ``envelopes.store_signed`` adds this node's proofs, ``read_signed`` asks ``accepts``."""

    def __init__(self, closed: ClosedSwarm | None, admitted: Collection[str] | None) -> None:
        self.closed = closed
        self.admitted = None if admitted is None else frozenset(admitted)
        self.logged: set[str] = set()

    def admits(self, peer: str) -> bool:
        """Whether ``peer`` (base58) may take part (always, without an admitted set)."""
        return self.admitted is None or peer in self.admitted

    def proof(self, key: str, author: str, payload: bytes) -> bytes | None:
        """What ``author``'s envelope of ``payload`` under ``key`` carries (None: open)."""
        return None if self.closed is None else self.closed.record_proof(key, author, payload)

    def accepts(self, key: str, author: str, payload: bytes, proof: bytes | None) -> bool:
        """Whether ``author``'s verified record under ``key`` counts; a refused author is
        logged once (a record is read again every few seconds)."""
        if not self.admits(author):
            self._log_once(author, NOT_ADMITTED)
            return False
        if self.closed is not None:
            expected = self.closed.record_proof(key, author, payload)
            if not self.closed.check(expected, proof):
                self._log_once(author, NOT_MEMBER)
                return False
        return True

    def _log_once(self, author: str, why: str) -> None:
        if author not in self.logged and len(self.logged) < MAX_LOGGED:
            self.logged.add(author)
            logger.warning("ignoring the records of %s: %s", author, why)


class AdmittedTransport:
    """A ``StreamTransport`` that serves and dials admitted peers only.

    Handlers added through it answer a peer that is not admitted with REJECT NOT_MEMBER
    (logged once per peer and handler) and nothing else; a stream to such a peer is never
    opened (``NotMember``, one of ``streams.TRANSPORT_ERRORS``).
    """

    def __init__(self, p2p: StreamTransport, admitted: Collection[str]) -> None:
        self.p2p, self.admitted = p2p, frozenset(admitted)
        self.logged: set[tuple[str, str]] = set()

    @property
    def peer_id(self) -> PeerID:
        return self.p2p.peer_id

    async def add_binary_stream_handler(self, name: str, handler: StreamHandler) -> None:
        async def guarded(
            info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            peer = info.peer_id.to_base58()
            if peer in self.admitted:
                await handler(info, reader, writer)
                return
            if (peer, name) not in self.logged and len(self.logged) < MAX_LOGGED:
                self.logged.add((peer, name))
                logger.warning("refused %s from %s: %s", short_name(name), peer, NOT_ADMITTED)
            reject = Reject(RejectCode.NOT_MEMBER, reason=NOT_ADMITTED)
            await send_reject(writer, reject, REFUSAL_TIMEOUT)
            await close_after_peer(reader, writer, REFUSAL_TIMEOUT)

        await self.p2p.add_binary_stream_handler(name, guarded)

    async def call_binary_stream_handler(
        self, peer_id: PeerID, handler_name: str
    ) -> tuple[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter]:
        if peer_id.to_base58() not in self.admitted:
            raise NotMember(f"{peer_id} is {NOT_ADMITTED} ({short_name(handler_name)})")
        return await self.p2p.call_binary_stream_handler(peer_id, handler_name)
