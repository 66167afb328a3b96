"""A node's records in the DHT, kept alive on a thread of their own (docs/design.md "The node
and its CLI").

A node's record, vouches, run configuration and metrics expire unless stored again within
``RECORD_TTL``. They are stored by ``Publisher``'s thread, which nothing else occupies: not
healing (one heal may try eight donors for half a minute each, far past the TTL), nor the
training thread (blocked at a round's receive step). The training thread only hands over
the newest record (``offer``); the thread stores it every ``PUBLISH_EVERY`` seconds, or at
once when a round was applied (the run configuration and the metrics, which decide no
round, at most every ``RECORD_TTL / 3`` and ``PUBLISH_EVERY``), and reads the others'
records back: how many nodes are alive (``on_records``) and their claimed step times
(``take_claims``). A leaving node replaces its record with one that says so (``leave``):
its peers stop counting it at once, not a ``RECORD_TTL`` later.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from diloco.node.observe.recent_metrics import RecentMetrics
from diloco.protocol.records.metrics import publish_metrics
from diloco.protocol.records.nodes import NodeRecord, Vouch, publish_record, publish_vouches
from diloco.protocol.records.run_configs import SignedRunConfig, publish_run_config
from diloco.protocol.swarm import Swarm
from diloco.protocol.trust.envelopes import MAX_RECORD_TTL

logger = logging.getLogger(__name__)

RECORD_TTL = 30.0
"""Seconds a node's DHT records live unless refreshed (they expire after a clean exit)."""
PUBLISH_EVERY = 5.0
"""Seconds between two refreshes of a node's records (sooner after a round)."""
VOUCH_TTL = MAX_RECORD_TTL
"""Seconds a node's vouches live unless refreshed: longer than its records, since a vouch
stays true after its author leaves, and the members left need it to heal a node that
missed that round (``diloco.node.evidence.claims``)."""
VOUCH_REFRESH = VOUCH_TTL / 3
"""Seconds after which unchanged vouches are stored again (before they expire)."""
LEFT_TTL = 2 * RECORD_TTL
"""Seconds a leaving node's last record (marked left) lives: it expires later than any
regular store of the node, so it replaces the regular record (the DHT keeps, per subkey,
the value that expires last) and readers drop the node at once."""
LEAVE_TIMEOUT = 3.0
"""Seconds ``leave`` waits for a store in flight, then for its own store: leaving is never
held up for long."""
JOIN_WAIT = 5.0
"""Seconds ``stop`` waits for the thread (a store in flight is cancelled by the swarm's
shutdown)."""

Vouches = Mapping[int, tuple[Vouch, ...]]
"""Fragment -> this node's vouches for its last applied rounds of it."""


class Publisher:
    """Stores one node's records from its own thread; ``offer`` and ``take_claims`` are
    the training thread's side, safe to call at any time.

    ``on_records`` is called on the publisher's thread with the run's live records after
    each store (the node sets its matchmaking target from them: it must be thread-safe).
    """

    def __init__(
        self,
        swarm: Swarm,
        signed: SignedRunConfig,
        recent: RecentMetrics,
        on_records: Callable[[list[NodeRecord]], None],
    ) -> None:
        self.swarm, self.signed, self.recent = swarm, signed, recent
        self.on_records = on_records
        self._lock = threading.Lock()
        self._latest: tuple[NodeRecord, Vouches] | None = None
        self._claims: dict[str, float] | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._left = threading.Event()
        self._storing = threading.Lock()
        """Held while the node record is stored: ``leave`` waits for a regular store in
        flight, and after it none starts."""
        self._thread = threading.Thread(target=self._run, name="diloco-publisher", daemon=True)
        self.vouches_stored: dict[int, tuple[tuple[Vouch, ...], float]] = {}
        """Fragment -> the vouches last stored and when (publisher thread only)."""
        self.config_stored_at = -math.inf
        self.metrics_stored_at = -math.inf
        """When the run configuration and the metrics were last stored (publisher thread)."""

    def offer(self, record: NodeRecord, vouches: Vouches, now: bool = False) -> None:
        """Publish ``record`` and ``vouches`` from the next store on (at once if ``now``)."""
        with self._lock:
            self._latest = (record, vouches)
        if now:
            self._wake.set()

    def take_claims(self) -> dict[str, float] | None:
        """The others' claimed full-batch step seconds read since the last call (peer id ->
        seconds); None when no read came in meanwhile."""
        with self._lock:
            claims, self._claims = self._claims, None
        return claims

    def start(self) -> None:
        """Store the newest record now (its first store: the node's matchmaking target
        and pace start from what it reads back), then keep storing it on the thread."""
        self.publish()
        self._thread.start()

    def stop(self) -> None:
        """Store no more (the records expire after ``RECORD_TTL``); a store in flight ends
        with it, or when the swarm shuts down."""
        self._stopping.set()
        self._wake.set()

    def leave(self) -> None:
        """Stop, then replace this node's record with its copy marked left, for
        ``LEFT_TTL`` (docs/design.md "The node and its CLI"). A regular store in flight is
        done before it (waited for ``LEAVE_TIMEOUT`` at most: if it is stuck, the left record
        still wins by its later expiration); none starts after. Bounded: a failure is one
        warning, the node leaves all the same and its record expires after ``RECORD_TTL``."""
        self.stop()
        self._left.set()
        acquired = self._storing.acquire(timeout=LEAVE_TIMEOUT)
        try:
            with self._lock:
                latest = self._latest
            if latest is None:  # never published: nothing to replace
                return
            record = latest[0].as_left()
            store = publish_record(self.swarm.dht, self.swarm.run_id, record, LEFT_TTL)
            self.swarm.call(store, timeout=LEAVE_TIMEOUT)
        except Exception as error:  # the node leaves all the same
            logger.warning("could not mark this node's record as left: %r", error)
        finally:
            if acquired:
                self._storing.release()

    def join(self) -> None:
        """Wait ``JOIN_WAIT`` at most for the thread to end (after ``stop``)."""
        if self._thread.is_alive():
            self._thread.join(JOIN_WAIT)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(PUBLISH_EVERY)
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                self.publish()
            except Exception as error:  # the DHT may fail a store; the next one retries
                if self._stopping.is_set():  # cancelled by the swarm's shutdown: the node left
                    return
                logger.warning("publishing this node's records failed: %r", error)

    def publish(self) -> None:
        """Store our record and vouches (new ones, and unchanged ones before they expire),
        then read the others' records.

        Matchmaking then ends as soon as every live node declared itself for a round,
        instead of always waiting out the window. Vouches go first: a peer that reads our
        record's new version should find our vouch for it.
        """
        with self._lock:
            latest = self._latest
        if latest is None:
            return
        record, vouches = latest
        now = time.monotonic()
        due = []
        for p, v in vouches.items():
            stored, stored_at = self.vouches_stored.get(p, ((), 0.0))
            if v and (v != stored or now - stored_at > VOUCH_REFRESH):
                due.append(v)
        if due:
            self.swarm.call(self._store_vouches(due))
            self.vouches_stored.update({v[0].fragment: (v, now) for v in due})
        with self._storing:
            if self._left.is_set():  # the node left: its left record stays the last
                return
            self.swarm.publish_record(record, ttl=RECORD_TTL)
        # The run configuration never changes: stored again well before it expires, not at
        # every store of the record (after each round), which made it a fifth of a
        # three-node swarm's DHT stores.
        if now - self.config_stored_at > RECORD_TTL / 3:
            self.swarm.call(publish_run_config(self.swarm.dht, self.signed, RECORD_TTL))
            self.config_stored_at = now
        records = self.swarm.read_records()
        self.on_records(records)
        # The others' claims; the trainer counts them only as far as their witnessed work
        # backs them, and adds its own figure as it is at each step (docs/design.md "Pace").
        claims = {
            r.peer_id: r.step_seconds
            for r in records
            if r.peer_id != record.peer_id and r.step_seconds is not None
        }
        with self._lock:
            self._claims = claims
        if now - self.metrics_stored_at >= PUBLISH_EVERY:  # for dashboards: it decides nothing
            metrics = self.recent.record()
            self.swarm.call(publish_metrics(self.swarm.dht, self.swarm.run_id, metrics, RECORD_TTL))
            self.metrics_stored_at = now

    async def _store_vouches(self, due: Sequence[Sequence[Vouch]]) -> None:
        dht, run_id = self.swarm.dht, self.swarm.run_id
        await asyncio.gather(*(publish_vouches(dht, run_id, v, VOUCH_TTL) for v in due))
