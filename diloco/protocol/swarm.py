"""The swarm handle: DHT, P2P and the protocol's event loop (``swarm_reducer`` reduces on it).

``Swarm`` owns one ``hivemind.DHT`` (a forked process: create the swarm before any CUDA work
or extra threads), a background thread running our asyncio loop, and a ``P2P`` client on
the DHT's daemon (``dht.replicate_p2p()``, created inside that loop). NAT port mapping,
AutoNAT and relays are off unless asked for: the defaults would probe the local router.
Everything runs on the loop; public methods are thread-safe and return concurrent futures
or block with a deadline.

Interface for the node (stable)::

    swarm = Swarm(run_id, NetworkOptions(initial_peers=(...)))  # DHT + P2P + loop thread
    # a closed swarm: Swarm(run_id, net, closed=ClosedSwarm(key, run_digest(run_id)))
    # admitted peers only (the creator's list, with the creator): Swarm(..., admitted={...})
    reducer = SwarmReducer(swarm, get_codec("e3m0"), timeouts=RoundTimeouts(...),
                           min_group_size=2)
    future = reducer.reduce(RoundKey(p, k), [Contribution(me, delta, weight)])
    result = future.result()          # RoundResult, or raises diloco.errors.RoundFailed
    swarm.publish_record(NodeRecord(...), ttl=60.0); swarm.read_records()
    swarm.serve_state(provider)       # provider() -> OuterState
    state = swarm.fetch_state(fragments=[p], expected_numel={p: n})
    swarm.shutdown()

Round semantics: every member of a group gets identical ``RoundResult.delta`` bytes and
``members`` (the full contributors: members counted in every part, in group order), or the
round fails for it; see ``allreduce`` for the agreement rule and its residual risk. With
``min_group_size=1`` a node that finds nobody gets its own decoded delta (docs/design.md "Algorithm
and schedule").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from hivemind import DHT
from hivemind.p2p import P2P, PeerID

from diloco.errors import ProtocolError
from diloco.protocol.records.nodes import (
    NodeRecord,
    RunRecords,
    Vouch,
    newest_donors,
    publish_record,
    read_records,
    read_records_and_vouches,
    read_run_records,
    record_validator,
)
from diloco.protocol.runtime import parent_end
from diloco.protocol.runtime.dht_upkeep import start_upkeep
from diloco.protocol.runtime.event_loop import new_event_loop, submit
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.runtime.reachability import DIAL_TIMEOUT, DialBackService, ask_dial_back
from diloco.protocol.runtime.reachability import verdict as reachability_verdict
from diloco.protocol.runtime.streams import TRANSPORT_ERRORS, StreamTransport
from diloco.protocol.state.fragment import OuterState
from diloco.protocol.state.transfer import StateProvider, StateServer, fetch_state
from diloco.protocol.trust.admission import AdmittedTransport, Membership
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.envelopes import SigningDHT
from diloco.protocol.trust.stalls import StallWatch
from diloco.protocol.trust.swarm_key import AUTH_TIMEOUT, ClosedSwarm, ClosedTransport
from diloco.protocol.wire.run_id import check_run_id, run_digest

logger = logging.getLogger(__name__)
T = TypeVar("T")

_DONOR_FAILURES: tuple[type[Exception], ...] = (
    ProtocolError,
    asyncio.TimeoutError,
    *TRANSPORT_ERRORS,
)
"""What makes ``fetch_state`` try the next donor: an invalid, vanished or slow donor."""


def make_dht(net: NetworkOptions) -> DHT:
    """Start this node's ``hivemind.DHT`` (and its p2pd) with the network options ``net``.

    NAT port mapping, AutoNAT and relays stay off unless asked for: the defaults would probe
    the local router. hivemind's check that a reused identity is free is off too: it starts
    a second daemon with NAT port mapping and AutoNAT on (it does not forward these options)
    and reads only RSA keys. Every node signs its records with its Ed25519 identity (a fresh
    one without ``identity_path``) and its DHT stores and returns only signed, owned records.
    """
    return SigningDHT(
        initial_peers=list(net.initial_peers),
        start=True,
        record_validators=[record_validator()],
        host_maddrs=list(net.host_maddrs),
        announce_maddrs=list(net.announce_maddrs) or None,
        identity_path=net.identity_path,
        use_relay=net.use_relay,
        use_auto_relay=net.use_relay,
        nat_port_map=net.nat_port_map,
        auto_nat=net.auto_nat,
        client_mode=net.client_mode,
        startup_timeout=net.startup_timeout,
        check_if_identity_free=False,
    )


class Swarm:
    """A running DHT node, its P2P client and the background event loop of the protocol."""

    def __init__(
        self,
        run_id: str,
        net: NetworkOptions | None = None,
        *,
        request_timeout: float = 30.0,
        dht: DHT | None = None,
        closed: ClosedSwarm | None = None,
        admitted: frozenset[str] | None = None,
    ) -> None:
        self.run_id = check_run_id(run_id)
        self.digest = run_digest(run_id)
        self.closed = closed
        self.request_timeout = request_timeout
        self.stalls = StallWatch()
        """This node's own stalls, watched on the swarm's loop: silence judged across one
        is not charged (``stalls``)."""
        self.bans = BanList(stalls=self.stalls)
        """Peers this node refuses for a while (``bans``): every part of the protocol, and
        whoever else catches a peer lying, reports offences here."""
        self.departed: frozenset[PeerID] = frozenset()
        """The peers whose record said they left the run, at the last ``read_records``."""
        net = net or NetworkOptions()
        self.net = net
        # A joiner that already read the run configuration through its own DHT hands it
        # over (one daemon per node); otherwise the swarm starts one.
        self.dht = dht or make_dht(net)
        if (closed is not None or admitted is not None) and isinstance(self.dht, SigningDHT):
            # every record this node stores carries its proof; outsiders' records are dropped
            self.dht.restrict(Membership(closed, admitted))
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="diloco-swarm", daemon=True)
        self._thread.start()
        # kept: the loop holds its tasks weakly
        self._watching = submit(self.stalls.run(), self._loop)
        self._state_server: StateServer | None = None
        try:
            self.p2p: P2P = self.call(self.dht.replicate_p2p(), net.startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        self.streams: StreamTransport = self.p2p
        """The run's streams: with an admitted set only admitted peers' streams are served
        (and only theirs are opened), checked first; in a closed swarm every one starts
        with the AUTH exchange."""
        if admitted is not None:
            self.streams = AdmittedTransport(self.streams, admitted)
        if closed is not None:
            self.streams = ClosedTransport(self.streams, closed, AUTH_TIMEOUT)
        try:
            self.call(DialBackService(self.p2p, self.run_id).start())
            start_upkeep(self.dht, net.initial_peers)
            # p2pd's addresses are fixed once it listens (hivemind reads them once, too):
            # read here, a node stopping with its DHT process gone never waits on it.
            self._maddrs = [str(addr) for addr in self.dht.get_visible_maddrs()]
        except BaseException:
            self.shutdown()
            raise

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    @property
    def peer_id(self) -> PeerID:
        return self.p2p.peer_id

    @property
    def maddrs(self) -> list[str]:
        """Full multiaddrs (with ``/p2p/<id>``) that other nodes bootstrap from."""
        return list(self._maddrs)

    def dialable(self, max_peers: int = 3) -> bool:
        """Whether other nodes can dial this one: asks up to ``max_peers`` initial peers to
        dial it back (``reachability``); True when forced a client is not asked for, when
        no initial peer is named (the first node) or when nobody answered (logged)."""
        if self.net.client_mode:
            return False
        peers = [
            PeerID.from_base58(a.rsplit("/p2p/", 1)[1])
            for a in self.net.initial_peers
            if "/p2p/" in a
        ]
        peers = list(dict.fromkeys(p for p in peers if p != self.peer_id))[:max_peers]
        if not peers:
            return True
        timeout = DIAL_TIMEOUT + self.net.startup_timeout / 10

        async def ask() -> list[int | None]:
            coros = (ask_dial_back(self.p2p, self.run_id, peer, timeout) for peer in peers)
            return list(await asyncio.gather(*coros))

        try:
            answers = self.call(ask(), 2 * timeout + 1)
        except concurrent.futures.TimeoutError:
            answers = []
        client = reachability_verdict(answers)
        if client is None:
            logger.warning("no peer answered the dial-back check: taking reducer parts")
        elif client:
            logger.warning(
                "no peer could dial this node back (behind NAT?): it trains as a client and "
                "reduces no part; forward a port and --announce it to reduce"
            )
        return not client

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the swarm's loop; the future can be awaited from any thread, and
        cancelling it gives the result up quietly (``event_loop.submit``)."""
        return submit(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it (at most ``timeout`` seconds)."""
        future = self.submit(coro)
        try:
            return future.result(timeout if timeout is not None else self.request_timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def publish_record(self, record: NodeRecord, ttl: float) -> bool:
        """Store this node's record for ``ttl`` seconds (docs/design.md "Wire formats")."""
        return self.call(publish_record(self.dht, self.run_id, record, ttl))

    def read_records(self) -> list[NodeRecord]:
        """Every valid unexpired node record of the run of a node still in it; who left is
        kept in ``departed``, for the rounds."""
        return self.call(self._read_records())

    async def _read_records(self) -> list[NodeRecord]:
        return self._note_departed(await read_run_records(self.dht, self.run_id))

    def read_records_and_vouches(
        self, fragments: Sequence[int]
    ) -> tuple[list[NodeRecord], list[Vouch]]:
        """``read_records`` and the vouches of ``fragments``, in one DHT call (a heal's check
        needs both)."""
        return self.call(self._read_records_and_vouches(fragments))

    async def _read_records_and_vouches(
        self, fragments: Sequence[int]
    ) -> tuple[list[NodeRecord], list[Vouch]]:
        found, vouches = await read_records_and_vouches(self.dht, self.run_id, fragments)
        return self._note_departed(found), vouches

    def _note_departed(self, found: RunRecords) -> list[NodeRecord]:
        self.departed = frozenset(PeerID.from_base58(peer) for peer in found.left)
        return found.live

    def serve_state(self, provider: StateProvider) -> None:
        """Answer state requests from now on with snapshots from ``provider``."""
        if self._state_server is not None:
            raise RuntimeError("serve_state was already called")
        server = StateServer(
            self.streams, self.run_id, self.digest, provider, self.request_timeout, self.bans
        )
        self.call(server.start())
        self._state_server = server

    def served_state_since(self, seconds: float) -> bool:
        """Whether a peer was sent this node's state in the last ``seconds``."""
        served = self._state_server.last_served if self._state_server is not None else None
        return served is not None and time.monotonic() - served < seconds

    def take_state_takers(self) -> dict[PeerID, float]:
        """The peers sent this node's state since the last call, and when
        (``time.monotonic()``); the swarm's loop only (``SwarmReducer``)."""
        return self._state_server.take_takers() if self._state_server is not None else {}

    def fetch_state(
        self,
        fragments: Sequence[int] | None = None,
        expected_numel: Mapping[int, int] | None = None,
        donors: Sequence[PeerID] | None = None,
        timeout: float | None = None,
        max_donors: int = 8,
    ) -> OuterState:
        """Download the outer state from the best donor that passes validation.

        Donors default to the peers whose records hold the newest versions of
        ``fragments`` (all fragments in ``expected_numel`` when None), best first; at most
        ``max_donors`` are tried (banned peers never), each for ``timeout`` seconds (default
        ``request_timeout``).

        Raises:
            ProtocolError: no donor delivered a valid state (the reasons are logged).
        """
        per_donor = timeout or self.request_timeout
        coro = self._fetch_state(fragments, expected_numel, donors, per_donor, max_donors)
        return self.call(coro, per_donor * (max_donors + 1))

    async def _fetch_state(
        self,
        fragments: Sequence[int] | None,
        expected_numel: Mapping[int, int] | None,
        donors: Sequence[PeerID] | None,
        timeout: float,
        max_donors: int,
    ) -> OuterState:
        hashes: dict[PeerID, dict[int, tuple[int, str]]] = {}
        if donors is None:
            records = await asyncio.wait_for(read_records(self.dht, self.run_id), timeout)
            wanted = list(fragments or sorted(expected_numel or ()))
            ranked = newest_donors(
                [r for r in records if r.peer_id != self.peer_id.to_base58()], wanted
            )
            donors = [PeerID.from_base58(r.peer_id) for r in ranked]
            for record in ranked:
                hashes[PeerID.from_base58(record.peer_id)] = {
                    f.fragment: (f.version, f.state_hash) for f in record.fragments
                }
        errors = []
        for donor in [d for d in donors if not self.bans.banned(d)][:max_donors]:
            try:
                return await asyncio.wait_for(
                    fetch_state(
                        self.streams,
                        donor,
                        self.run_id,
                        self.digest,
                        fragments,
                        expected_numel,
                        hashes.get(donor),
                    ),
                    timeout,
                )
            except _DONOR_FAILURES as exc:
                logger.warning("state from %s rejected: %r", donor, exc)
                errors.append(f"{donor}: {exc!r}")
        raise ProtocolError(f"no donor delivered a valid state ({len(errors)} tried): {errors}")

    def shutdown(self, timeout: float = 2.0) -> None:
        """Leave the swarm within about ``timeout`` seconds, at most about three more when
        something has to be killed: a node's Ctrl-C must not hang on a busy daemon (docs/design.md
        "The node and its CLI").

        Every task on the loop is cancelled first (rounds, state transfers, DHT requests):
        a thread blocked in ``call`` then returns at once instead of after its own timeout,
        which would also hold up the interpreter's exit. Then the DHT process is asked to
        stop p2pd and exit. On a loaded machine either can stall; what still runs at the
        deadline is terminated, then killed, by its PID (p2pd through a pidfd opened while
        it was the DHT process's child, so that a reused PID is never signalled), and the
        daemon's socket file is removed.
        """
        deadline = time.monotonic() + timeout

        def remaining(at_least: float = 0.1) -> float:
            return max(at_least, deadline - time.monotonic())

        p2p: P2P | None = getattr(self, "p2p", None)

        async def leave() -> None:
            await _cancel_tasks(remaining())
            if p2p is not None:
                await p2p.shutdown()  # no child to wait for: closes our client and its socket

        daemons = parent_end.child_pidfds(self.dht.pid) if self.dht.is_alive() else []
        if self._loop.is_running():
            try:
                self.call(leave(), remaining() + 0.5)
            except Exception as exc:
                logger.debug("leaving the loop: %r", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(remaining())
        if not self._thread.is_alive() and not self._loop.is_closed():
            # Calls submitted while the loop stopped; once it is closed, new ones fail at once.
            self._loop.run_until_complete(_cancel_tasks(0.5))
            self._loop.close()
        self.dht.shutdown_timeout = remaining(0.5)
        self.dht.shutdown()  # terminates the DHT process if it misses the deadline
        if self.dht.is_alive():
            self.dht.join(0.5)
            if self.dht.is_alive():
                self.dht.kill()
                self.dht.join(0.5)
        # A DHT process that exited by itself has stopped p2pd; nothing else will.
        if parent_end.stop(daemons) and p2p is not None:
            with contextlib.suppress(OSError):
                os.remove(p2p.daemon_listen_maddr["unix"])

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


async def _cancel_tasks(wait: float) -> None:
    """Cancel the loop's other tasks, again if cancelling started new ones (``wait`` s)."""
    end = time.monotonic() + wait
    current = asyncio.current_task()
    while (tasks := asyncio.all_tasks() - {current}) and time.monotonic() < end:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=end - time.monotonic())
