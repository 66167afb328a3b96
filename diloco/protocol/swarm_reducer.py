"""``SwarmReducer``: the trainer's view of the protocol, reducing fragment rounds with the
swarm's other nodes over a ``Swarm`` (matchmaking, then one all-reduce per group)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import math
import time
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any

import torch
from hivemind.utils import get_dht_time

from diloco.codecs import Codec
from diloco.errors import PriorDiverged, RoundFailed
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.allreduce.routing import RoundRouter
from diloco.protocol.allreduce.runners import Faults, RoundRunners
from diloco.protocol.core.adaptive import RECENT_ROUNDS, round_trip_estimate
from diloco.protocol.core.aggregation import CLIP_FACTOR, check_clip_factor, weighted_mean
from diloco.protocol.core.budget import RoundBudget
from diloco.protocol.core.demotion import Demotion
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.partition import butterfly_parts
from diloco.protocol.core.reducer import Contribution, Reducer, RoundKey, RoundResult
from diloco.protocol.core.verification import slices_alone
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.records.nodes import read_records
from diloco.protocol.runtime import round_trips
from diloco.protocol.runtime.processes import HelperEnded
from diloco.protocol.staged.groups import grid_for
from diloco.protocol.staged.runner import StagedRunner
from diloco.protocol.swarm import Swarm
from diloco.protocol.trust.envelopes import SigningDHT
from diloco.protocol.wire.frames import Join

logger = logging.getLogger(__name__)

RTT_KINDS = ("join", "check")
"""Exchanges a round trip measures: one request and its answer (``round_trips``)."""
SERVED_MEMORY = 60.0
"""Seconds after it sent its state to a peer during which a node applies no round of one:
that peer starts from the state sent and looks for this node in its rounds, and its record
may reach this node's reads only seconds later (a round of one meanwhile left a creator at a
state of its own, which its new peers then outvoted: docs/design.md "Healing and joining")."""


class SwarmReducer(Reducer):
    """Reduces fragment rounds with the other nodes of the swarm; one per ``Swarm``.

    ``reduce`` returns at once; matchmaking and the all-reduce run on the swarm's loop and
    the future resolves by the round's end (``RoundBudget.round_end``: ``timeouts.total``
    seconds, or an all-reduce and its checks after a group its leader chose late, a staged
    round a few all-reduces and their checks more per stage). With
    ``target_group_size`` (e.g. the number of live node records) matchmaking ends as soon as
    that many peers declared, instead of after the whole window. ``max_weight`` caps every
    member's weight (tokens, the run's cap) and ``clip_factor`` is the C of the reducers'
    norm clipping (``aggregation``; 0: off). ``bans`` is the swarm's. ``faults`` picks the
    classes that run this node's side of a round (``runners.Faults``; tests only).

    With ``verify`` (the default) every chunk is signed with the node's identity and every
    member checks the others' averages (``verification``): a reducer caught lying fails the
    round here and is banned (``bans``).
    ``verify=False`` is for measuring what that costs; every node of a swarm must then run
    without it (unsigned chunks are refused by nodes that verify).
    A ``client`` (nobody can dial it: ``reachability``) takes part in every round but
    reduces no part and never leads; a node whose own part keeps failing becomes one for a
    while (``demotion``). With ``max_group_size`` (the run's, alike on every node) a group of
    more members runs in stages on a grid (``staged_runner``); None: always one flat group.
    With ``rounds_of_one`` (a node's choice) a node alone in the run applies its own outer
    gradient when no group forms (``_group_or_alone``); without, such a round fails.
    """

    def __init__(
        self,
        swarm: Swarm,
        codec: Codec,
        return_codec: Codec | None = None,
        *,
        timeouts: RoundTimeouts | None = None,
        min_group_size: int = 2,
        target_group_size: int | None = None,
        max_norm_ratio: float = 100.0,
        max_weight: float = math.inf,
        clip_factor: float = CLIP_FACTOR,
        verify: bool = True,
        client: bool = False,
        demotion: Demotion | None = None,
        max_group_size: int | None = None,
        rounds_of_one: bool = False,
        faults: Faults | None = None,
    ) -> None:
        if not max_norm_ratio > 1:
            raise ValueError(f"max_norm_ratio must be > 1, got {max_norm_ratio}")
        check_clip_factor(clip_factor)
        self.swarm, self.codec, self.return_codec = swarm, codec, return_codec or codec
        self.bans, self.max_weight, self.clip_factor = swarm.bans, max_weight, clip_factor
        self.timeouts = timeouts or RoundTimeouts()
        self.min_group_size, self.max_norm_ratio = min_group_size, max_norm_ratio
        self.identity = swarm.dht.identity if verify else None
        if verify and not slices_alone(self.return_codec):
            logger.warning(
                "averages encoded with %r cannot be recomputed by block: they are signed, "
                "not checked",
                self.return_codec,
            )
        self.client, self.max_group_size = client, max_group_size
        self.rounds_of_one, self.faults = rounds_of_one, faults
        self.demotion = demotion or Demotion()
        self.matchmaker = Matchmaker(
            swarm.streams,
            swarm.dht,
            swarm.run_id,
            swarm.digest,
            self.timeouts,
            self.bans,
            min_group_size,
            target_group_size,
            max_weight,
            swarm.closed,
            lambda: swarm.departed,
        )
        if isinstance(swarm.dht, SigningDHT) and swarm.dht.reused_identity:
            # a previous process may have run under this peer id: its declarations live on
            self.matchmaker.restarted_at = get_dht_time()
        self.router = RoundRouter(
            swarm.streams, swarm.run_id, swarm.digest, self.timeouts, self.bans
        )
        self.timings: collections.OrderedDict[RoundKey, tuple[float, float]] = (
            collections.OrderedDict()
        )
        """(matchmaking seconds, all-reduce seconds) of the last rounds, oldest first."""
        self.grouped: set[RoundKey] = set()
        """The rounds whose group formed and whose all-reduce runs (``in_group``)."""
        self.transfers: collections.deque[float] = collections.deque(maxlen=RECENT_ROUNDS)
        """Transfer times of the last rounds with every part on the first try (``adaptive``)."""
        self.rtt_samples: collections.deque[float] = collections.deque(maxlen=RECENT_ROUNDS)
        """The shortest JOIN or CHECK exchange of each of the last rounds: what the round
        trip to the peers is (``adaptive.round_trip_estimate``)."""
        swarm.call(self._start())

    async def _start(self) -> None:
        await self.matchmaker.start()
        await self.router.start()

    def peers_window(self, rtt: float | None) -> float:
        """The matchmaking window the peers give this node's rounds: the run's, stretched to
        ``rtt`` (the caller's ``round_trip_estimate`` of ``rtt_samples``); not the widest one
        this node itself waits while a peer is out of step with it (``matchmaking.late``)."""
        return RoundBudget.of(self.timeouts, rtt).matching.matchmaking_window

    def set_target_group_size(
        self, size: int, live_nodes: int | None = None, counted: int | None = None
    ) -> None:
        """From any thread: end matchmaking as soon as ``size`` peers declared a round (the
        nodes with witnessed work), tell followers how many nodes are live (every record's
        author; an open round waits for them), and how many peers ``size`` counts before
        its floor (``Matchmaker.counted``). Set on the swarm's loop, which reads them.

        Raises:
            ValueError: ``size`` below ``min_group_size``.
        """
        if size < self.min_group_size:
            raise ValueError(f"target_group_size {size} is below min_group_size")
        self.swarm.submit(self._set_target_group_size(size, live_nodes, counted))

    async def _set_target_group_size(
        self, size: int, live_nodes: int | None, counted: int | None
    ) -> None:
        self.matchmaker.target_group_size = size
        self.matchmaker.live_nodes = live_nodes
        self.matchmaker.counted = counted

    def reached_before(self, keys: Iterable[RoundKey]) -> None:
        """From any thread, before the rounds start: ``keys``, the rounds this node's
        previous process reached by its notes, are sat out (``Ahead.reached_before``)."""
        rounds = list(keys)

        async def note() -> None:
            self.matchmaker.reached_before(rounds)

        self.swarm.call(note())

    def set_behind(self, behind: bool) -> None:
        """From any thread: whether this node is behind the swarm, so the rounds it leads
        alone are late ones (``LatePeers.set_behind``)."""

        async def note() -> None:
            self.matchmaker.late.set_behind(behind)

        self.swarm.submit(note())

    def in_group(self, key: RoundKey) -> bool:
        """From any thread: whether round ``key`` is past matchmaking, in its all-reduce.
        Its group waits for this node's parts and reports, so a stopping node finishes such a
        round (within its deadline) rather than leaving its group to time out
        (docs/design.md "The node and its CLI")."""
        return key in self.grouped

    def close(self) -> None:
        """Stop answering this reducer's streams; rounds in flight fail or finish by their
        deadlines. The swarm itself stays up (``Swarm.shutdown`` ends it)."""
        for name in (self.matchmaker.handler_name, *self.router.transport.handlers):
            try:
                self.swarm.call(self.swarm.p2p.remove_binary_stream_handler(name), 5.0)
            except Exception as exc:  # the daemon may already be gone at shutdown
                logger.debug("removing handler %s: %r", name, exc)

    def prepare(self, key: RoundKey, numel: int, weight: float, prior: str, lead: float) -> None:
        """Declare round ``key`` and read who else did before its send step, so that the
        round's path starts at JOIN -> GROUP (``ahead``)."""
        request = self.matchmaker.join_request(
            key,
            numel,
            self.codec.codec_id,
            self.return_codec.codec_id,
            weight,
            self.client or self.demotion.demoted,
        )
        self.swarm.submit(self._open_ahead(key, request, prior, lead))

    async def _open_ahead(self, key: RoundKey, request: Join, prior: str, lead: float) -> None:
        self.matchmaker.open_ahead(key, request, prior, not self.client, lead)

    def forgo(self, key: RoundKey) -> None:
        self.swarm.submit(self._forgo(key))

    async def _forgo(self, key: RoundKey) -> None:
        self.matchmaker.forgo(key)

    def reduce(
        self, key: RoundKey, contributions: Sequence[Contribution]
    ) -> concurrent.futures.Future[RoundResult]:
        if len(contributions) != 1:
            raise ValueError(
                f"a swarm node has exactly one local contribution, got {len(contributions)}"
            )
        contribution = contributions[0]
        delta = contribution.delta
        if delta.dtype != torch.float32 or delta.dim() != 1 or delta.device.type != "cpu":
            raise ValueError("the delta must be a 1-D float32 CPU tensor")
        return self.swarm.submit(self._counted(key, self._reduce(key, contribution)))

    async def _counted(
        self, key: RoundKey, reduce: Coroutine[Any, Any, RoundResult]
    ) -> RoundResult:
        """``reduce``, with the round trips on its critical path counted (``round_trips``):
        logged, and in the result."""
        with round_trips.counting() as trips:
            try:
                result = await reduce
            finally:
                spans = [end - begin for kind, begin, end in trips.exchanges if kind in RTT_KINDS]
                if spans:
                    self.rtt_samples.append(min(spans))
                path = trips.critical_path()
                summary = round_trips.path_summary(path)
                logger.debug("round %s: %d round trips: %s", key, len(path), summary)
        return dataclasses.replace(result, round_trips=tuple(path))

    async def _reduce(self, key: RoundKey, contribution: Contribution) -> RoundResult:
        start = asyncio.get_running_loop().time()
        now = time.monotonic()
        for peer, at in self.swarm.take_state_takers().items():
            self.matchmaker.late.took_state(peer, start - (now - at))
        out_of_step = self.matchmaker.late.out_of_step(start)
        rtt = round_trip_estimate(self.rtt_samples)
        # the last round waits for the peers it counts (none: a node alone loses nothing)
        last = contribution.last and self.matchmaker.peers_counted >= 1
        wide = out_of_step or last
        budget = RoundBudget.of(self.timeouts, rtt, out_of_step=wide)
        self.matchmaker.timeouts = budget.matching  # the rounds in matchmaking now follow it too
        if out_of_step:
            logger.info("round %s: a peer came after our rounds ended: the widest window", key)
        elif last:
            logger.info("round %s: the run's last of this fragment: the widest window", key)
        try:
            async with asyncio.timeout_at(budget.round_end(start)) as deadline:
                return await self._reduce_inner(key, contribution, budget, start, deadline)
        except RoundFailed as exc:
            logger.debug("%s", exc)  # the caller reports failed rounds
            raise
        except asyncio.TimeoutError as exc:
            raise RoundFailed(key.fragment, key.round, "round deadline passed") from exc
        except HelperEnded as exc:  # the node is stopping: one line, no traceback
            logger.warning("round %s: %s", key, exc)
            raise RoundFailed(key.fragment, key.round, "the DHT process ended") from exc
        except Exception as exc:
            logger.exception("round %s failed unexpectedly", key)
            raise RoundFailed(key.fragment, key.round, f"internal error: {exc!r}") from exc

    async def _reduce_inner(
        self,
        key: RoundKey,
        contribution: Contribution,
        budget: RoundBudget,
        start: float,
        deadline: asyncio.Timeout,
    ) -> RoundResult:
        loop = asyncio.get_running_loop()
        delta = contribution.delta.detach().contiguous()
        slot = self.router.expect(key)
        reduced, failed = False, False  # a round without a group serves a demotion too
        try:
            group = await self._group_or_alone(key, contribution)
            reduced = group is not None and not group.is_client(group.index(self.swarm.peer_id))
            matched = loop.time()
            runner: AllReduceRunner | StagedRunner
            if group is None or len(group.members) == 1:
                names = group.names if group else (self.swarm.peer_id.to_base58(),)
                result = await loop.run_in_executor(None, self._alone, delta, names)
                decided = time.monotonic()
                result = dataclasses.replace(result, withdrawn=lambda: self._taken(decided))
            else:
                grid = grid_for(group, self.max_group_size, self.max_weight)
                net = self.swarm.net
                budget = budget.adapted(
                    self.transfers,
                    factor=net.transfer_timeout_factor,
                    floor=net.min_transfer_timeout,
                )
                runners = self._runners(budget)
                stages = None if grid is None else grid.num_stages
                deadline.reschedule(budget.round_end(start, stages, matched))
                if grid is None:
                    runner = runners(group, delta, self.max_weight)
                else:
                    runner = StagedRunner(
                        group=group,
                        plan=grid,
                        me=self.swarm.peer_id,
                        delta=delta,
                        factory=runners.in_stages(),
                        budget=budget,
                        max_weight=self.max_weight,
                    )
                slot.set_result(runner)
                self.grouped.add(key)
                try:
                    result = await runner.run()
                finally:  # also when the round fails or its deadline cancels it
                    failed = runner.part_missing
                    self.grouped.discard(key)
                if runner.transfer_seconds is not None:
                    self.transfers.append(runner.transfer_seconds)
        finally:
            self.router.finish(key)
            self.demotion.record(reduced, failed)
        self.timings[key] = (matched - start, loop.time() - matched)
        while len(self.timings) > 64:
            self.timings.popitem(last=False)
        return dataclasses.replace(
            result, seconds=loop.time() - start, matchmaking_seconds=matched - start
        )

    async def _group_or_alone(self, key: RoundKey, contribution: Contribution) -> GroupInfo | None:
        """The round's group; None when no group formed and the node is alone in the run (a
        round of one: docs/design.md "Algorithm and schedule").

        Alone means that matchmaking failed (not on a diverged prior: that node heals), that
        no other peer declared the round, and that the run holds no live record but this
        node's, both in a fresh read and in the last one the node's publisher made
        (``Matchmaker.live_nodes``): one read can come back empty on a slow network; nor did
        it send its state to a peer in the last ``SERVED_MEMORY`` seconds (a joiner). A node
        that knows of any peer keeps failing such rounds as before: a round of one among
        peers would leave it at another state than theirs. Peers that declared the round
        and formed a group without this node may have left the run since (they finished,
        docs/design.md "Healing and joining"): their records are gone, their round is not.
        """
        try:
            return await self.matchmaker.form_group(
                key,
                contribution.delta.numel(),
                self.codec.codec_id,
                self.return_codec.codec_id,
                float(contribution.weight),
                contribution.prior,
                client=self.client or self.demotion.demoted,
                may_lead=not self.client,
            )
        except PriorDiverged:
            raise
        except RoundFailed as failure:
            if not self.rounds_of_one or failure.others_declared:
                raise
            if (self.matchmaker.live_nodes or 0) > 1:
                raise
            if self.swarm.served_state_since(SERVED_MEMORY):
                raise
            me = self.swarm.peer_id.to_base58()
            records = await read_records(self.swarm.dht, self.swarm.run_id)
            if any(r.peer_id != me for r in records):
                raise
            return None

    def _runners(self, budget: RoundBudget) -> RoundRunners:
        """The runners of one round here, on its ``budget``."""
        return RoundRunners(
            transport=self.router.transport,
            digest=self.swarm.digest,
            codec=self.codec,
            return_codec=self.return_codec,
            budget=budget,
            max_norm_ratio=self.max_norm_ratio,
            clip_factor=self.clip_factor,
            bans=self.bans,
            identity=self.identity,
            faults=self.faults,
        )

    def _taken(self, decided: float) -> str | None:
        """Why a round of one decided at ``decided`` (``time.monotonic()``) no longer holds:
        a peer took this node's state since, without it."""
        if self.swarm.served_state_since(time.monotonic() - decided):
            return "a peer took this node's state before its round of one was applied"
        return None

    def _alone(self, delta: torch.Tensor, names: tuple[str, ...]) -> RoundResult:
        """A group of one: the node's own delta through both codecs (docs/design.md "Algorithm and
        schedule")."""
        start = time.perf_counter()
        ((lo, hi),) = butterfly_parts(delta.numel(), 1)
        own = self.codec.decode(self.codec.encode(delta[lo:hi].contiguous()))
        mean = weighted_mean([own], [1.0])
        result = self.return_codec.decode(self.return_codec.encode(mean))
        return RoundResult(result, names, 0, 0, time.perf_counter() - start)
