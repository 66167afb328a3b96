"""Can other nodes dial this one? A dial-back check, so that a node behind NAT becomes a
client by itself.

A node that nobody can dial cannot lead a round (followers JOIN the leader) or reduce a
part (members open PART streams to the reducer); as a *client* it still trains with the
swarm (``allreduce``). hivemind's AutoNAT would tell p2pd, but p2pd's API does not report
the result, and it asks peers the node never chose; hivemind's relays would make the node
dialable through another peer's bandwidth. Both stay off unless the user asks
(``NetworkOptions``). Instead, after joining, the node asks a few of its initial peers:

    request   u16 length | JSON list of up to ``MAX_ADDRS`` [ip, port] it listens on
    answer    one byte: ``REACHABLE``, ``UNREACHABLE`` or ``REFUSED``

The peer opens plain TCP connections (no data) to those addresses, each within
``DIAL_TIMEOUT``, and answers whether one was accepted. It dials only addresses on the IP
the request came from (``StreamInfo.addr``: behind NAT, the router's) or, when that IP is
not global, on non-global IPs (a LAN; loopback only from loopback), so that nobody can
make it dial a third party on the internet; one request per peer per
``REQUEST_INTERVAL``. A node behind a masquerading router lists its private address, which
the peer cannot reach: client.
No answer at all (old peers, a failure) leaves the node a reducer, and it says so.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)

REACHABLE, UNREACHABLE, REFUSED = 1, 0, 2
MAX_ADDRS = 4
MAX_REQUEST_BYTES = 1024
DIAL_TIMEOUT = 3.0
"""Seconds one dial-back TCP connection may take."""
REQUEST_INTERVAL = 60.0
"""Seconds between two dial-backs for the same peer."""

Address = tuple[str, int]


def handler_name(run_id: str) -> str:
    return f"/diloco/{run_id}/dialback/1"


def tcp_addresses(maddrs: Sequence[Multiaddr]) -> list[Address]:
    """The ``(ip, port)`` of every IPv4/IPv6 TCP multiaddr, in order, without repeats."""
    found: list[Address] = []
    for maddr in maddrs:
        protocols = {p.name for p in maddr.protocols()}
        if "tcp" not in protocols:
            continue
        ip = next((maddr.value_for_protocol(p) for p in ("ip4", "ip6") if p in protocols), None)
        address = (ip, int(maddr.value_for_protocol("tcp"))) if ip else None
        if address is not None and address not in found:
            found.append(address)
    return found


def dial_targets(requested: object, observed_ip: str) -> list[Address]:
    """The addresses of a request a peer may be dialled back at (module docstring).

    Raises:
        ValueError: not a list of at most ``MAX_ADDRS`` ``[ip, port]`` pairs.
    """
    if not isinstance(requested, list) or len(requested) > MAX_ADDRS:
        raise ValueError(f"expected a list of at most {MAX_ADDRS} addresses")
    observed = ipaddress.ip_address(observed_ip)
    targets = []
    for item in requested:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], int)):
            raise ValueError(f"address {item!r:.80} is not [ip, port]")
        ip, port = ipaddress.ip_address(str(item[0])), item[1]
        if not 0 < port < 65536:
            raise ValueError(f"port {port} out of range")
        if ip.is_unspecified or ip.is_multicast:
            continue
        if ip.is_loopback != observed.is_loopback:
            continue  # another machine's loopback is not this one's
        if ip == observed or (not observed.is_global and not ip.is_global):
            targets.append((str(ip), port))
    return targets


async def _dial(address: Address) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*address), DIAL_TIMEOUT)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


class DialBackService:
    """Answers other nodes' dial-back requests (module docstring)."""

    def __init__(self, p2p: P2P, run_id: str) -> None:
        self.p2p, self.name = p2p, handler_name(run_id)
        self._last: dict[PeerID, float] = {}

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.name, self._handle)

    async def _handle(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            answer = await asyncio.wait_for(self._answer(info, reader), 2 * DIAL_TIMEOUT + 2)
            writer.write(bytes([answer]))
            await asyncio.wait_for(writer.drain(), DIAL_TIMEOUT)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            logger.info("dial-back request from %s failed: %r", info.peer_id, exc)
        finally:
            writer.close()

    async def _answer(self, info: StreamInfo, reader: asyncio.StreamReader) -> int:
        size = int.from_bytes(await reader.readexactly(2), "big")
        if size > MAX_REQUEST_BYTES:
            raise ValueError(f"request of {size} bytes")
        requested = json.loads(await reader.readexactly(size))
        now = time.monotonic()
        if now - self._last.get(info.peer_id, -REQUEST_INTERVAL) < REQUEST_INTERVAL:
            return REFUSED
        self._last[info.peer_id] = now
        observed = tcp_addresses([info.addr])
        if not observed:
            return UNREACHABLE  # came over a relay or another transport: not dialable
        targets = dial_targets(requested, observed[0][0])
        dialled = await asyncio.gather(*(_dial(address) for address in targets))
        logger.info("dial-back of %s at %s: %s", info.peer_id, targets, dialled)
        return REACHABLE if any(dialled) else UNREACHABLE


async def ask_dial_back(p2p: P2P, run_id: str, peer: PeerID, timeout: float) -> int | None:
    """Ask ``peer`` to dial this node back; its answer, or None when it gave none."""
    try:
        addresses = tcp_addresses(await p2p.get_visible_maddrs())[:MAX_ADDRS]
        body = json.dumps([[ip, port] for ip, port in addresses]).encode()
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(peer, handler_name(run_id)), timeout
        )
        try:
            writer.write(len(body).to_bytes(2, "big") + body)
            await writer.drain()
            answer = (await asyncio.wait_for(reader.readexactly(1), timeout))[0]
        finally:
            writer.close()
    except Exception as exc:  # a peer did not answer: documented as None
        logger.info("no dial-back answer from %s: %r", peer, exc)
        return None
    return answer if answer in (REACHABLE, UNREACHABLE) else None


def verdict(answers: Sequence[int | None]) -> bool | None:
    """Whether this node is a client: True when every peer that answered could not dial it,
    False when one could, None when nobody answered (then it stays a reducer)."""
    given = [a for a in answers if a is not None]
    if not given:
        return None
    return all(a == UNREACHABLE for a in given)
