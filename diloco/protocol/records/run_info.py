"""RUN_INFO: a joiner asks the peer whose address it was given which run it trains.

Every node registers the handler ``RUN_INFO_HANDLER`` (one name for all runs: the joiner
does not know the run yet) and answers each stream with one frame::

    RUN_INFO   SignedRunConfig payload (``discovery``): run id, configuration, creator's
               signature

libp2p authenticates the responder's peer id, which the joiner takes from the ``/p2p/``
part of the address it was given; the joiner checks that the configuration hashes to the
run id and carries its creator's signature, and follows that run. So a hostile peer can
publish any configuration it likes under any name: a joiner never meets it unless it was
given the hostile peer's own address. With several initial peers, ``choose_run`` takes the
run they agree on, or the one ``--run-id`` names. RUN_INFO is open to everyone, also in a
closed swarm: the configuration names the key by its hash (``swarm_key_id``), never the key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from hivemind.p2p import PeerID

from diloco.errors import ConfigError, ProtocolError
from diloco.protocol.records.run_configs import MAX_SIGNED_CONFIG_BYTES, SignedRunConfig
from diloco.protocol.runtime.streams import (
    TRANSPORT_ERRORS,
    StreamTransport,
    open_stream,
    read_frame,
    stream_handler,
    write_frame,
)
from diloco.protocol.trust.identity import public_key_of
from diloco.protocol.wire.frames import Kind, Reject

logger = logging.getLogger(__name__)

_ENDED: tuple[type[Exception], ...] = (*TRANSPORT_ERRORS, asyncio.TimeoutError)
"""A stream that ended early: cut, refused, or past its deadline."""

RUN_INFO_HANDLER = "/diloco/run-info/1"
RUN_INFO_TIMEOUT = 10.0
"""Seconds a RUN_INFO exchange may take, on either side."""


async def serve_run_info(p2p: StreamTransport, signed: SignedRunConfig) -> None:
    """Answer RUN_INFO streams with ``signed`` from now on."""
    payload = signed.to_payload()

    async def serve(
        peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        await write_frame(writer, Kind.RUN_INFO, payload)
        return None

    handler = stream_handler(
        "RUN_INFO", serve, timeout=RUN_INFO_TIMEOUT, reply_timeout=RUN_INFO_TIMEOUT
    )
    await p2p.add_binary_stream_handler(RUN_INFO_HANDLER, handler)


async def fetch_run_info(p2p: StreamTransport, peer: PeerID) -> SignedRunConfig:
    """The run ``peer`` trains, verified (hash and creator's signature).

    Raises:
        ProtocolError: a refusal, a malformed answer or a bad signature.
        ConfigError: a configuration that is not JSON, too large or deep, or does not hash
            to its run id.
        streams.TRANSPORT_ERRORS, asyncio.TimeoutError: the peer did not answer.
    """
    reader, writer = await open_stream(p2p, peer, RUN_INFO_HANDLER, RUN_INFO_TIMEOUT)
    try:
        kind, body = await asyncio.wait_for(
            read_frame(reader, (Kind.RUN_INFO,), MAX_SIGNED_CONFIG_BYTES), RUN_INFO_TIMEOUT
        )
    finally:
        writer.close()
    if kind == Kind.REJECT:
        reject = Reject.parse(body)
        raise ProtocolError(f"refused RUN_INFO: {reject.code.name} {reject.reason}")
    return SignedRunConfig.from_payload(bytes(body))


async def ask_peers(
    p2p: StreamTransport, peers: Sequence[str], attempts: int = 3, pause: float = 2.0
) -> dict[str, SignedRunConfig | str]:
    """Ask every peer (base58 ids) for its run at once; each answer is its verified signed
    configuration or why there is none. A peer that does not answer is asked up to
    ``attempts`` times (a fresh daemon's first dial can fail)."""

    async def ask(peer: str) -> SignedRunConfig | str:
        error: BaseException | None = None
        for attempt in range(attempts):
            if attempt:
                logger.info("%s did not answer RUN_INFO yet (%r); again", peer, error)
                await asyncio.sleep(pause)
            try:
                return await fetch_run_info(p2p, PeerID.from_base58(peer))
            except (ProtocolError, ConfigError) as exc:
                logger.warning("%s answered RUN_INFO with an invalid run: %s", peer, exc)
                return f"invalid answer: {exc}"
            except _ENDED as exc:
                error = exc
        return f"no answer: {error!r}"

    answers = await asyncio.gather(*(ask(peer) for peer in peers))
    return dict(zip(peers, answers, strict=True))


def choose_run(answers: Mapping[str, SignedRunConfig | str], run_id: str | None) -> SignedRunConfig:
    """The run to join, from the initial peers' RUN_INFO ``answers`` (by peer id).

    With ``run_id`` (``--run-id``): that run, if any initial peer trains it. Without: the run
    every answering peer trains; peers that disagree are refused, never outvoted.

    Raises:
        ConfigError: no peer answered, the pinned run is not among the answers, or the
            peers train different runs; the message lists what each peer said.
    """
    runs: dict[str, SignedRunConfig] = {}
    by_run: dict[str, list[str]] = {}
    for peer, answer in answers.items():
        if isinstance(answer, SignedRunConfig):
            runs[answer.run_id] = answer
            by_run.setdefault(answer.run_id, []).append(peer)
    said = "; ".join(
        f"{peer}: {a.run_id if isinstance(a, SignedRunConfig) else a}"
        for peer, a in answers.items()
    )
    if run_id is not None:
        if run_id in runs:
            return runs[run_id]
        raise ConfigError(f"no initial peer trains run {run_id} ({said})")
    if not runs:
        raise ConfigError(f"no initial peer told which run it trains ({said})")
    if len(runs) > 1:
        raise ConfigError(
            f"the initial peers train different runs ({said}); "
            "pick one with --run-id, or give the address of a node of the run you mean"
        )
    return next(iter(runs.values()))


def peer_id_in(address: str) -> str:
    """The peer id of a full multiaddr: its last ``/p2p/<id>`` (after any relay's).

    Raises:
        ConfigError: the address names no Ed25519 peer id (every node of ours has one).
    """
    parts = address.split("/")
    ids = [parts[i + 1] for i in range(len(parts) - 1) if parts[i] == "p2p"]
    if not ids:
        raise ConfigError(
            f"address {address} names no peer (/p2p/<peer id>); "
            "copy a whole address that the node printed"
        )
    try:
        public_key_of(ids[-1])
    except ProtocolError as exc:
        raise ConfigError(f"address {address}: {exc}") from exc
    return ids[-1]
