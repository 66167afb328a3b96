"""Upkeep of the DHT's routing table: peers it dropped are asked back.

hivemind's DHT node drops a peer from its routing table when one request to it goes
unanswered, and bans it for 5 s, doubling at each miss. It never asks a dropped peer again
unless that peer calls first. A node whose whole machine stalled for a few seconds (a laptop
lid, swap, a SIGSTOP) comes back with its requests timed out at once, and the peers dropped
it meanwhile for the same reason: each side waits for the other, and the node reads only its
own records while p2p still reaches everyone. It then trains alone (docs/design.md
"Healing and joining").

So, in the DHT process, every ``UPKEEP_PERIOD_S``, the node pings each peer it knows of
(its initial peers and the peers p2pd is connected to) that is missing from its routing
table or banned. A ping that answers puts the peer back (and, the ping asking to be added,
this node back in the peer's table) and lifts its ban. A client-mode node is not asked to
be added, as hivemind does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections.abc import Sequence
from typing import Any

from hivemind import DHT
from hivemind.p2p import PeerID

logger = logging.getLogger(__name__)

UPKEEP_PERIOD_S = 10.0
"""Seconds between two checks: a node back from a stall reads its peers' records again
within about this long (records live 30 s)."""
MAX_PINGS = 16
"""Peers pinged per check at most (chosen at random): a large swarm's p2pd may hold more
connections than a routing table keeps, and the table has room for a few anyway."""


def start_upkeep(dht: DHT, initial_peers: Sequence[str], period: float = UPKEEP_PERIOD_S) -> None:
    """Start the upkeep in ``dht``'s process (it ends with that process)."""
    ids = tuple(a.rsplit("/p2p/", 1)[1] for a in initial_peers if "/p2p/" in a)
    dht.run_coroutine(functools.partial(_start, initial=ids, period=period))


async def _start(dht: DHT, node: Any, *, initial: tuple[str, ...], period: float) -> None:
    # the task is held by the node: the loop keeps only weak references to tasks
    node.diloco_upkeep = asyncio.create_task(_upkeep(node, initial, period))


async def _upkeep(node: Any, initial: tuple[str, ...], period: float) -> None:
    while True:
        await asyncio.sleep(period)
        try:
            back = await ask_back(node, initial)
        except Exception:  # a stopping daemon, a closed client: the next period tries again
            logger.debug("routing table upkeep failed", exc_info=True)
            continue
        if back:
            logger.info("DHT: %d peer(s) back in the routing table: %s", len(back), back)


async def ask_back(node: Any, initial: Sequence[str]) -> list[str]:
    """Ping the known peers missing from ``node``'s routing table or banned (at most
    ``MAX_PINGS``); returns those that answered (now in the table, their ban lifted)."""
    known = {PeerID.from_base58(p) for p in initial}
    with contextlib.suppress(Exception):  # a daemon that cannot list: initial peers alone
        known.update(info.peer_id for info in await node.p2p.list_peers())
    known.discard(node.peer_id)
    table = node.protocol.routing_table
    missing = [p for p in known if table.get(peer_id=p) is None or p in node.blacklist]
    missing = random.sample(missing, min(len(missing), MAX_PINGS))
    answers = await asyncio.gather(*(node.protocol.call_ping(p) for p in missing))
    back = [p for p, node_id in zip(missing, answers, strict=True) if node_id is not None]
    for peer in back:
        if peer in node.blacklist:
            node.blacklist.register_success(peer)
    return [p.to_base58() for p in back]
