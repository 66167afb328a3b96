"""Closed swarms: only holders of the run's shared key take part (docs/design.md "Threat model").

A closed run is started with ``--swarm-key FILE`` (at least ``MIN_KEY_BYTES`` random
bytes). Its configuration carries ``swarm_key_id`` (``SwarmKey.key_id``, a hash that does
not reveal the key), so a closed run has its own run id and a joiner without the key, or
with another one, is told so before it does anything (``check_swarm_key``).

Every stream of the run starts with an AUTH exchange (``ClosedTransport`` wraps the
transport, so every handler and every caller of the run gets it, present and future)::

    opener    -> responder   AUTH  HMAC(key, input("open",   digest, handler, opener, responder))
    responder -> opener      AUTH  HMAC(key, input("answer", digest, handler, opener, responder))
                             or REJECT NOT_MEMBER, and the stream ends
    input(...) = signing_input("diloco-auth/1", ...), digest = the 16-byte run digest

The responder checks the opener's proof against the peer id libp2p authenticated; the
opener checks the answer before it sends its request, so neither side gives anything to
an outsider (no group, no parts, no state), and both log a refusal with the peer id. The
proofs are bound to the direction, the run, the handler and both peer ids: an outsider
that sees or is sent a proof cannot use it on any other stream. Cost: one round trip and
two HMACs per stream, in closed swarms only.

Every DHT record of a closed swarm carries ``record_proof`` in its envelope (HMAC over the
run digest, the record's key, its author's peer id and the sha256 of its payload:
``envelopes``, ``admission.Membership``); readers drop records without a valid one, so
what an outsider stores (node records, vouches, metrics, declarations) reaches no member.
Round declarations also carry ``declaration_proof`` (HMAC over the run digest, the round key
and the declaring peer id) inside their payload, as before records had proofs.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from diloco.errors import ConfigError, ProtocolError
from diloco.protocol.runtime.streams import (
    TRANSPORT_ERRORS,
    StreamHandler,
    StreamTransport,
    close_after_peer,
    read_frame,
    send_reject,
    write_frame,
)
from diloco.protocol.trust.identity import signing_input, write_private_file
from diloco.protocol.wire.frames import Kind, Reject, RejectCode

logger = logging.getLogger(__name__)

_ENDED: tuple[type[Exception], ...] = (*TRANSPORT_ERRORS, asyncio.TimeoutError)
"""A stream that ended early: cut, refused, or past its deadline."""

MIN_KEY_BYTES = 32
MAX_KEY_BYTES = 4096
PROOF_BYTES = 32
AUTH_TIMEOUT = 10.0
"""Seconds either side of a stream waits for the other's AUTH frame."""
KEY_ID_DOMAIN = b"diloco-swarm-key"
AUTH_DOMAIN = "diloco-auth/1"
DECLARATION_DOMAIN = "diloco-declaration/1"
RECORD_DOMAIN = "diloco-record-proof/1"
NOT_MEMBER = "not a member of this closed swarm"
HOW_TO_MAKE_ONE = "make one with `diloco-node keygen --swarm-key FILE`"


class NotMember(ConnectionRefusedError):
    """A stream of a closed swarm refused because one side does not hold the key; like any
    refused stream it is one of ``streams.TRANSPORT_ERRORS``."""


@dataclass(frozen=True, slots=True)
class SwarmKey:
    """The shared secret of a closed swarm."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not MIN_KEY_BYTES <= len(self.secret) <= MAX_KEY_BYTES:
            raise ConfigError(
                f"a swarm key holds {MIN_KEY_BYTES} to {MAX_KEY_BYTES} random bytes, "
                f"not {len(self.secret)}; {HOW_TO_MAKE_ONE}"
            )

    @property
    def key_id(self) -> str:
        """16 hex digits of sha256("diloco-swarm-key" || key): names the key, reveals nothing."""
        return hashlib.sha256(KEY_ID_DOMAIN + self.secret).hexdigest()[:16]

    @classmethod
    def generate(cls) -> SwarmKey:
        return cls(secrets.token_bytes(MIN_KEY_BYTES))

    def write(self, path: str | Path) -> None:
        """Write the key to a new file readable by its owner only (mode 0600).

        Raises:
            ConfigError: the file exists or cannot be created.
        """
        write_private_file(path, self.secret, "swarm key file")


def load_swarm_key(path: str | Path) -> SwarmKey:
    """The key in the file at ``path`` (its whole content).

    Raises:
        ConfigError: unreadable, or not ``MIN_KEY_BYTES`` to ``MAX_KEY_BYTES`` long.
    """
    try:
        with open(path, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            secret = file.read(MAX_KEY_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read swarm key file {path}: {exc.strerror}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("swarm key file %s is readable by others; chmod 600 it", path)
    try:
        return SwarmKey(secret)
    except ConfigError as exc:
        raise ConfigError(f"swarm key file {path}: {exc}") from exc


def check_swarm_key(run_id: str, key_id: str | None, key: SwarmKey | None) -> None:
    """Say clearly whether a node holding ``key`` can take part in a run whose
    configuration carries ``key_id`` (None: an open swarm).

    Raises:
        ConfigError: naming what is missing or wrong.
    """
    if key_id is None and key is not None:
        raise ConfigError(f"run {run_id} is an open swarm; drop --swarm-key")
    if key_id is not None and key is None:
        raise ConfigError(
            f"run {run_id} is a closed swarm (swarm key id {key_id}); join it with "
            "--swarm-key FILE holding its key (ask the run's creator)"
        )
    if key_id is not None and key is not None and key.key_id != key_id:
        raise ConfigError(
            f"your swarm key (id {key.key_id}) is not the key of run {run_id} (id {key_id}); "
            "ask the run's creator for its key file"
        )


@dataclass(frozen=True, slots=True)
class ClosedSwarm:
    """The proofs of membership of one closed run (pure: no I/O)."""

    key: SwarmKey
    digest: bytes
    """The run digest (``run_id.run_digest``): proofs of one run are void in another."""

    def stream_proof(self, direction: str, handler: str, opener: str, responder: str) -> bytes:
        """The AUTH proof of the ``"open"`` or ``"answer"`` side of a stream to ``handler``
        from peer ``opener`` to peer ``responder`` (base58 peer ids)."""
        message = signing_input(AUTH_DOMAIN, direction, self.digest, handler, opener, responder)
        return self._mac(message)

    def declaration_proof(self, round_key: str, peer: str) -> bytes:
        """What ``peer`` adds to its declaration under ``round_key`` to show it is a member."""
        return self._mac(signing_input(DECLARATION_DOMAIN, self.digest, round_key, peer))

    def record_proof(self, key: str, author: str, payload: bytes) -> bytes:
        """What the envelope of ``author``'s record under DHT key ``key`` carries to show its
        author holds the key: bound to this run, the key, the author and the payload's hash,
        so it proves nothing for another author's record or another payload."""
        digest = hashlib.sha256(payload).digest()
        return self._mac(signing_input(RECORD_DOMAIN, self.digest, key, author, digest))

    def check(self, expected: bytes, proof: object) -> bool:
        """Whether ``proof`` (from a peer: anything) equals ``expected``, in constant time."""
        return isinstance(proof, bytes | bytearray) and hmac.compare_digest(expected, proof)

    def _mac(self, message: bytes) -> bytes:
        return hmac.new(self.key.secret, message, hashlib.sha256).digest()


def short_name(handler: str) -> str:
    """``/diloco/<run>/join/1`` -> ``JOIN``: the handler as log lines name it."""
    parts = handler.strip("/").split("/")
    return parts[-2].upper() if len(parts) >= 2 else handler


class ClosedTransport:
    """A ``StreamTransport`` whose every stream starts with the AUTH exchange.

    Handlers added through it answer only peers that prove they hold the key; streams
    opened through it return only once the responder proved it too, else raise
    ``NotMember``. ``timeout`` bounds the exchange on both sides.
    """

    def __init__(self, p2p: StreamTransport, closed: ClosedSwarm, timeout: float) -> None:
        self.p2p, self.closed, self.timeout = p2p, closed, timeout

    @property
    def peer_id(self) -> PeerID:
        return self.p2p.peer_id

    async def add_binary_stream_handler(self, name: str, handler: StreamHandler) -> None:
        async def guarded(
            info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            try:
                admitted = await asyncio.wait_for(
                    self._answer(name, info, reader, writer), self.timeout
                )
            except _ENDED as exc:
                logger.debug("%s AUTH from %s ended: %r", short_name(name), info.peer_id, exc)
                writer.close()
                return
            if admitted:
                await handler(info, reader, writer)
            else:  # refused: closed at once, p2pd could reset the stream and cut the REJECT
                await close_after_peer(reader, writer, self.timeout)

        await self.p2p.add_binary_stream_handler(name, guarded)

    async def _answer(
        self,
        name: str,
        info: StreamInfo,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Check the opener's proof; answer with ours, or refuse (and log) it."""
        opener, me = info.peer_id.to_base58(), self.peer_id.to_base58()
        try:
            _, proof = await read_frame(reader, (Kind.AUTH,), PROOF_BYTES)
            valid = self.closed.check(self.closed.stream_proof("open", name, opener, me), proof)
        except ProtocolError:  # no AUTH first (a node without the key) or a malformed one
            valid = False
        if not valid:
            logger.warning("refused %s from %s: %s", short_name(name), opener, NOT_MEMBER)
            await send_reject(
                writer, Reject(RejectCode.NOT_MEMBER, reason=NOT_MEMBER), self.timeout
            )
            return False
        await write_frame(writer, Kind.AUTH, self.closed.stream_proof("answer", name, opener, me))
        return True

    async def call_binary_stream_handler(
        self, peer_id: PeerID, handler_name: str
    ) -> tuple[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter]:
        info, reader, writer = await self.p2p.call_binary_stream_handler(peer_id, handler_name)
        try:
            await asyncio.wait_for(self._prove(handler_name, peer_id, reader, writer), self.timeout)
        except BaseException:
            writer.close()
            raise
        return info, reader, writer

    async def _prove(
        self,
        name: str,
        peer: PeerID,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        me, responder = self.peer_id.to_base58(), peer.to_base58()
        await write_frame(writer, Kind.AUTH, self.closed.stream_proof("open", name, me, responder))
        kind, body = await read_frame(reader, (Kind.AUTH,), PROOF_BYTES)
        if kind == Kind.REJECT:
            reason = Reject.parse(body).reason
            logger.warning("%s refused %s from us: %s", responder, short_name(name), reason)
            raise NotMember(f"{responder} refused {short_name(name)}: {reason}")
        expected = self.closed.stream_proof("answer", name, me, responder)
        if not self.closed.check(expected, bytes(body)):
            logger.warning("%s is %s (%s)", responder, NOT_MEMBER, short_name(name))
            raise NotMember(f"{responder} is {NOT_MEMBER}")
