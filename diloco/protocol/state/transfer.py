"""Serving and fetching the outer state of a run (docs/design.md "Healing and joining").

A donor answers a STATE_REQ with a STATE_HDR (global step; per fragment its version,
length and sha256) followed by one STATE_DAT frame per fragment holding the raw
little-endian FP32 outer parameters and then the outer momentum. The fetcher validates
everything before use: run digest, exactly the fragments it asked for, lengths against
what it expects, finiteness, and the sha256 of the bytes against the header (and against
the hash the donor published in the DHT when the versions match). A donor that fails any
check is skipped and the next one is tried.

A donor caps what peers can make it do (``limits``): one state
stream per peer at a time, a few requests per minute per peer, a few streams in total;
refusals are answered with REJECT BUSY and logged once per peer. It hashes each snapshot's
fragments once (``SnapshotHashes``), not once per request.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from hivemind.p2p import PeerID

from diloco.errors import ProtocolError
from diloco.protocol.runtime import streams
from diloco.protocol.state.fragment import FragmentState, OuterState, fp32_bytes
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.limits import StreamLimiter, StreamLimits
from diloco.protocol.wire.frames import Kind, Reject, RejectCode
from diloco.protocol.wire.state import StateEntry, StateHeader, StateRequest

logger = logging.getLogger(__name__)

MAX_STATE_NUMEL = 2**33
"""Largest fragment a fetcher accepts when it has no expected size (8 G values)."""

MAX_REFUSALS_LOGGED = 10_000
"""Peers remembered as logged for a refusal; beyond, the memory is cleared."""
REJECT_TIMEOUT = 2.0
"""Seconds to tell a refused peer why."""

StateProvider = Callable[[], OuterState]
"""Returns a consistent snapshot of the current outer state; called off the event loop.
A snapshot's fragments are never changed afterwards (the server caches their hashes)."""


MAX_TAKERS = 64
"""Peers sent a state kept until the reducer reads them (any peer may ask)."""


class SnapshotHashes:
    """sha256 of snapshot fragments, once per fragment object.

    Keyed by object identity, with a weak reference that drops the entry when the snapshot
    goes: an identity reused by a later object never finds a stale hash, and the cache
    keeps no state alive.
    """

    def __init__(self) -> None:
        self._hashes: dict[int, tuple[weakref.ref[FragmentState], str]] = {}

    def get(self, state: FragmentState) -> str | None:
        entry = self._hashes.get(id(state))
        return entry[1] if entry is not None and entry[0]() is state else None

    def put(self, state: FragmentState, digest: str) -> None:
        key = id(state)
        self._hashes[key] = (weakref.ref(state, lambda _: self._hashes.pop(key, None)), digest)

    def __len__(self) -> int:
        return len(self._hashes)


class StateServer:
    """Answers STATE_REQ streams from the provider's snapshot, within ``limits``; banned
    peers get nothing."""

    def __init__(
        self,
        p2p: streams.StreamTransport,
        run_id: str,
        digest: bytes,
        provider: StateProvider,
        timeout: float,
        bans: BanList,
        limits: StreamLimits | None = None,
    ) -> None:
        self.p2p, self.digest, self.provider, self.timeout = p2p, digest, provider, timeout
        self.bans = bans
        self.handler_name = state_handler_name(run_id)
        self.limiter = StreamLimiter(limits or StreamLimits())
        self.hashes = SnapshotHashes()
        self.refused: set[str] = set()
        """Peers already logged for a refusal."""
        self.last_served: float | None = None
        """``time.monotonic()`` when a peer was last sent a state: it will start from it and
        look for this node in its rounds (``SwarmReducer``: no round of one meanwhile)."""
        self.takers: dict[PeerID, float] = {}
        """Peers sent a state since ``take_takers`` last asked -> when (``time.monotonic()``;
        at most ``MAX_TAKERS``, the oldest go first)."""
        self._hashing = asyncio.Lock()

    async def start(self) -> None:
        handler = streams.stream_handler(
            "STATE_REQ",
            self._serve,
            timeout=self.timeout,
            reply_timeout=self.timeout,
            admit=self.bans.admit,
        )
        await self.p2p.add_binary_stream_handler(self.handler_name, handler)

    async def _serve(
        self, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        # The request is read before the caps are checked: a refusal sent before it would
        # cut the stream under the fetcher's write, which then never reads the REJECT.
        _, body = await streams.read_frame(reader, (Kind.STATE_REQ,))
        request = StateRequest.parse(body)
        if request.digest != self.digest:
            return Reject(RejectCode.WRONG_RUN, reason="different run configuration")
        name = peer.to_base58()
        refusal = self.limiter.admit(name, time.monotonic())
        if refusal is not None:
            # Answered here rather than returned: the stream wrapper would log every one.
            self._log_refusal(name, refusal)
            reject = Reject(RejectCode.BUSY, reason=refusal)
            await streams.send_reject(writer, reject, REJECT_TIMEOUT)
            return None
        self.last_served = time.monotonic()  # before the snapshot: a round of one may follow
        self.takers.pop(peer, None)
        self.takers[peer] = self.last_served
        while len(self.takers) > MAX_TAKERS:
            del self.takers[next(iter(self.takers))]
        try:
            return await self._send_state(request, writer)
        finally:
            self.limiter.release(name)

    def take_takers(self) -> dict[PeerID, float]:
        """The peers sent a state since the last call, and when; forgets them."""
        takers, self.takers = self.takers, {}
        return takers

    async def _send_state(
        self, request: StateRequest, writer: asyncio.StreamWriter
    ) -> Reject | None:
        loop = asyncio.get_running_loop()
        snapshot = await loop.run_in_executor(None, self.provider)
        wanted = request.fragments or tuple(sorted(snapshot.fragments))
        missing = [p for p in wanted if p not in snapshot.fragments]
        if missing:
            return Reject(RejectCode.NO_STATE, reason=f"no state for fragments {missing}")
        states = [snapshot.fragments[p] for p in wanted]
        hashes = await self._hash(states)
        header = StateHeader(
            self.digest,
            snapshot.global_step,
            tuple(
                StateEntry(p, s.version, s.outer.numel(), bytes.fromhex(h))
                for p, s, h in zip(wanted, states, hashes, strict=True)
            ),
        )
        await streams.write_frame(writer, Kind.STATE_HDR, header.serialize())
        for state in states:
            await streams.write_frame(
                writer, Kind.STATE_DAT, fp32_bytes(state.outer), fp32_bytes(state.momentum)
            )
        return None

    async def _hash(self, states: Sequence[FragmentState]) -> list[str]:
        """The hashes of ``states``, each computed once per snapshot (off the loop; one
        computation at a time, so that concurrent requests wait for it instead of
        hashing the same snapshot twice)."""
        async with self._hashing:
            new = [s for s in states if self.hashes.get(s) is None]
            if new:
                loop = asyncio.get_running_loop()
                digests = await loop.run_in_executor(None, lambda: [s.sha256() for s in new])
                for state, digest in zip(new, digests, strict=True):
                    self.hashes.put(state, digest)
            hashes = [self.hashes.get(s) for s in states]
        # Put above; ``states`` keeps their entries alive.
        return [h for h in hashes if h is not None]

    def _log_refusal(self, peer: str, reason: str) -> None:
        if peer in self.refused:
            logger.debug("state request from %s refused: %s", peer, reason)
            return
        if len(self.refused) >= MAX_REFUSALS_LOGGED:
            self.refused.clear()
        self.refused.add(peer)
        logger.warning("state requests from %s refused (BUSY): %s", peer, reason)


def state_handler_name(run_id: str) -> str:
    return f"/diloco/{run_id}/state/1"


async def fetch_state(
    p2p: streams.StreamTransport,
    peer: PeerID,
    run_id: str,
    digest: bytes,
    fragments: Sequence[int] | None = None,
    expected_numel: Mapping[int, int] | None = None,
    expected_hashes: Mapping[int, tuple[int, str]] | None = None,
) -> OuterState:
    """Download and validate the outer state of ``fragments`` (None: all) from ``peer``.

    ``expected_numel`` maps fragment to its length; ``expected_hashes`` maps fragment to
    the ``(version, hex hash)`` the donor published, checked when the versions match.

    Raises:
        ProtocolError: any validation failure (the state must not be used).
        streams.TRANSPORT_ERRORS: the donor vanished. The caller bounds the time.
    """
    _, reader, writer = await p2p.call_binary_stream_handler(peer, state_handler_name(run_id))
    try:
        request = StateRequest(digest, tuple(fragments or ()))
        await streams.write_frame(writer, Kind.STATE_REQ, request.serialize())
        kind, body = await streams.read_frame(reader, (Kind.STATE_HDR,))
        if kind == Kind.REJECT:
            reject = Reject.parse(body)
            raise ProtocolError(f"donor refused: {reject.code.name} {reject.reason}")
        header = StateHeader.parse(body)
        if header.digest != digest:
            raise ProtocolError("state of another run")
        got = [e.fragment for e in header.entries]
        if fragments is not None and got != list(fragments):
            raise ProtocolError(f"asked for fragments {list(fragments)}, header has {got}")
        if expected_numel is not None and fragments is None and set(got) != set(expected_numel):
            raise ProtocolError(f"expected fragments {sorted(expected_numel)}, got {got}")
        states: dict[int, FragmentState] = {}
        for entry in header.entries:
            states[entry.fragment] = await _read_fragment(
                reader, entry, expected_numel, expected_hashes
            )
        return OuterState(header.global_step, states)
    finally:
        writer.close()


async def _read_fragment(
    reader: asyncio.StreamReader,
    entry: StateEntry,
    expected_numel: Mapping[int, int] | None,
    expected_hashes: Mapping[int, tuple[int, str]] | None,
) -> FragmentState:
    numel = entry.numel
    expected = None if expected_numel is None else expected_numel.get(entry.fragment)
    if expected_numel is not None and expected != numel:
        raise ProtocolError(f"fragment {entry.fragment}: {numel} values, expected {expected}")
    if numel > MAX_STATE_NUMEL:
        raise ProtocolError(f"fragment {entry.fragment}: {numel} values is over the limit")
    frame = await streams.read_frame_header(reader)
    if frame.kind != Kind.STATE_DAT or frame.body_len != 8 * numel:
        raise ProtocolError(f"{frame.kind.name} of {frame.body_len} bytes, expected {8 * numel}")
    raw = await streams.read_body(reader, frame.body_len)
    if hashlib.sha256(raw).digest() != entry.sha256:
        raise ProtocolError(f"fragment {entry.fragment}: bytes do not match the header's sha256")
    if expected_hashes is not None and entry.fragment in expected_hashes:
        version, published = expected_hashes[entry.fragment]
        if version == entry.version and published != entry.sha256.hex():
            raise ProtocolError(f"fragment {entry.fragment}: hash differs from the DHT record")
    values = torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float32, copy=True))
    state = FragmentState(values[:numel].clone(), values[numel:].clone(), entry.version)
    state.check()
    return state
