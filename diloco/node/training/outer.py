"""The outer loop of Streaming DiLoCo: one piece of code for every transport (docs/design.md
"Algorithm and schedule").

``FragmentSync`` wraps an unchanged inner loop (torchtitan's ``maybe_semi_sync_training``
shape): at the end of every step the trainer asks it which fragments send
(``contributions_due``), hands those to a ``Reducer`` (in-process or swarm) and gives the
returned futures back (``submit``); ``apply_due`` then blocks, at a round's receive step
``s + tau`` only, and applies the outer Nesterov step and the ``alpha`` merge. The outer
state (FP32 parameters and momentum per fragment) stays on the CPU and is updated with the
same float operations in the same order everywhere, so all members of a round end with
bit-identical outer state (docs/design.md "Algorithm and schedule").

A CUDA model's fragments travel through ``diloco.node.model.device_link``: the send step queues
an asynchronous copy and a worker thread starts the round once it is complete; the new
outer parameters go back asynchronously and are merged on the device. The outer state
stays in pinned host memory (the outer update unchanged, on the CPU) unless the node asks
for it on the device (``outer_device="device"``: no host copies of the live weights, but an
update whose rounding may differ from a CPU node's, so such a node can disagree with the
others' state hash and heal).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from diloco.errors import ConfigError, PriorDiverged, RoundFailed
from diloco.node.model.device_link import DeviceLink
from diloco.node.model.fragments import sends_at
from diloco.node.training.outer_config import OuterConfig, check_tau
from diloco.node.training.outer_step import assign, flatten, merge, nesterov_step
from diloco.node.training.pending import AppliedRound, PendingRound
from diloco.protocol.core.reducer import Contribution, RoundKey, RoundResult
from diloco.protocol.state.fragment import FragmentState

logger = logging.getLogger(__name__)

ABANDON_POLL_SECONDS = 0.1

OuterDevice = Literal["cpu", "device"]
ReduceFn = Callable[[RoundKey, Contribution], Future[RoundResult]]
"""Starts one round with this replica's contribution (a ``Reducer.reduce`` of one)."""


@dataclass
class FragmentSync:
    """One replica's outer loop over all fragments (the algorithm of docs/design.md "Algorithm and
    schedule").

    ``fragments`` are the named parameters of each fragment (``model_fragments``); ``tau`` is
    this replica's own delay (heterogeneous slack is allowed: all members send at ``s``, each
    receives at ``s + tau``).
    """

    fragments: list[list[tuple[str, nn.Parameter]]]
    config: OuterConfig
    member: str
    tau: int
    states: list[FragmentState] = field(init=False)
    pending: list[PendingRound] = field(init=False, default_factory=list)
    tokens_since_send: list[float] = field(init=False)
    carried_weight: list[float] = field(init=False)
    failed_rounds: int = field(init=False, default=0)
    should_abandon: Callable[[RoundKey], bool] = field(default=lambda _: False, repr=False)
    """Asked of a round while blocked on it; True gives the round up (a node that is
    stopping, of a round its group does not wait for yet)."""
    refuse: Callable[[RoundResult], str | None] = field(default=lambda _: None, repr=False)
    """Asked of each result before it is applied: a reason fails the round (the swarm node:
    a round without the run's creator before it has worked with anyone)."""
    outer_device: OuterDevice = "cpu"
    """Where a CUDA model's outer state lives (``NodeOptions.outer_device``); CPU models
    keep it on the CPU either way."""
    link: DeviceLink | None = field(init=False, default=None, repr=False)
    """The asynchronous copies of a CUDA model; None for a CPU model."""
    hashes: dict[int, str] = field(init=False, default_factory=dict, repr=False)
    """``state_hash`` of the fragments unchanged since it was computed."""

    def __post_init__(self) -> None:
        check_tau(self.tau, self.config.sync_every)
        self.states = []
        first = next((p for params in self.fragments for _, p in params), None)
        device = first.device if first is not None else torch.device("cpu")
        if device.type == "cuda":
            self.link = DeviceLink(device, [sum(p.numel() for _, p in f) for f in self.fragments])
        for params in self.fragments:
            outer = flatten(params)
            if self.link is not None and self.outer_device == "device":
                outer = outer.to(device)
            elif self.link is not None:
                outer = outer.pin_memory()
            momentum = torch.zeros_like(outer)
            momentum = momentum.pin_memory() if outer.is_pinned() else momentum
            self.states.append(FragmentState(outer=outer, momentum=momentum))
        self.tokens_since_send = [0.0] * len(self.fragments)
        self.carried_weight = [0.0] * len(self.fragments)

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def state_hash(self, p: int) -> str:
        """``states[p].sha256()``, computed once per change of the state (records are
        published often; hashing the whole outer state each time costs a step's percent)."""
        if p not in self.hashes:
            self.hashes[p] = self.states[p].sha256()
        return self.hashes[p]

    @property
    def alpha(self) -> float:
        return self.config.alpha_for(self.tau)

    def in_flight(self) -> set[int]:
        """Fragments with a round sent and not yet applied that may still change their state
        (one that failed already will not: healing need not wait for its receive step)."""
        return {r.key.fragment for r in self.pending if r.failure() is None}

    def diverged(self) -> dict[RoundKey, str]:
        """Rounds in flight that failed already because most of their peers start from
        another state than ours (``PriorDiverged``), with that state's hash prefix."""
        failures = {r.key: r.failure() for r in self.pending}
        return {k: e.prior for k, e in failures.items() if isinstance(e, PriorDiverged)}

    def record_tokens(self, tokens: int) -> None:
        """Count the tokens of one inner step toward every fragment's next round weight."""
        for p in range(self.num_fragments):
            self.tokens_since_send[p] += tokens

    def contributions_due(self, step: int) -> list[tuple[RoundKey, Contribution]]:
        """Outer gradients ``outer_p - theta[p]`` of the fragments that send at ``step``."""
        due = []
        for p, k in sends_at(step, self.config.sync_every, self.num_fragments):
            delta = self.states[p].outer - flatten(self.fragments[p])
            contribution = Contribution(
                self.member, delta, self._take_weight(p), self.state_hash(p)
            )
            due.append((RoundKey(p, k), contribution))
        return due

    def _take_weight(self, p: int) -> float:
        """The weight of fragment ``p``'s round sent now: tokens since its last send, plus
        those of failed rounds (docs/design.md "Algorithm and schedule" step 6)."""
        weight = self.tokens_since_send[p] + self.carried_weight[p]
        self.tokens_since_send[p] = 0.0
        return weight or 1.0

    def send_due(self, step: int, reduce: ReduceFn) -> None:
        """Start the rounds of the fragments that send at ``step`` (docs/design.md "Algorithm and
        schedule" steps 1-2).

        A CPU model computes the outer gradients here (``contributions_due``); a CUDA model
        only queues copies, and its worker hands each round to ``reduce`` once its copy is
        complete, so the training thread does not wait for the device.
        """
        if self.link is None:
            for key, contribution in self.contributions_due(step):
                self.submit(key, reduce(key, contribution), step, contribution.weight)
            return
        for p, k in sends_at(step, self.config.sync_every, self.num_fragments):
            key, weight, prior = RoundKey(p, k), self._take_weight(p), self.state_hash(p)

            def start(
                delta: torch.Tensor, key: RoundKey = key, weight: float = weight, prior: str = prior
            ) -> Future[RoundResult]:
                return reduce(key, Contribution(self.member, delta, weight, prior))

            future = self.link.send(p, self.states[p].outer, self.fragments[p], start)
            self.submit(key, future, step, weight)

    def set_tau(self, tau: int) -> None:
        """Use ``tau`` for the rounds sent from now on (``--tau auto``,
        ``diloco.node.training.tau``): each round in flight keeps the receive step it was given when
        sent, and as ``tau < H`` a fragment's previous round is applied before its next one is sent,
        so rounds still apply in order."""
        check_tau(tau, self.config.sync_every)
        self.tau = tau

    def submit(self, key: RoundKey, future: Future[RoundResult], step: int, weight: float) -> None:
        """Remember a round in flight; it is applied at ``step + tau`` (the tau of now)."""
        self.pending.append(PendingRound(key, future, step + self.tau, weight))

    def apply_due(self, step: int) -> list[AppliedRound]:
        """Block on the rounds whose receive step is ``step`` and apply them."""
        applied = []
        for pending in [r for r in self.pending if r.receive_step <= step]:
            self.pending.remove(pending)
            applied.append(self._apply(pending))
        return applied

    def finish(self) -> list[AppliedRound]:
        """At the run's end: block on every round still in flight and apply it, in the
        order of their receive steps (docs/design.md "Algorithm and schedule" steps 4-5), so that
        the final evaluation and the exported weights hold the rounds sent in the last ``tau``
        steps.

        A stopping node (``should_abandon``) gives its rounds up as ``apply_due`` does.
        """
        applied = []
        for pending in sorted(self.pending, key=lambda r: r.receive_step):
            self.pending.remove(pending)
            applied.append(self._apply(pending))
        return applied

    def wait_kept(self) -> None:
        """A stopping node: wait for the rounds in flight that ``should_abandon`` keeps (those
        whose group waits for this node), each until it ends, which its deadline bounds. Their
        results stay pending: a checkpoint saves them, to be applied at their receive steps
        after a resume (``state_dict``)."""
        while kept := [
            r.future for r in self.pending if not r.future.done() and not self.should_abandon(r.key)
        ]:
            concurrent.futures.wait(kept, ABANDON_POLL_SECONDS, concurrent.futures.FIRST_COMPLETED)

    def _wait(self, pending: PendingRound) -> RoundResult:
        """The round's result; polls so that a stopping node can abandon the wait."""
        while True:
            try:
                return pending.future.result(timeout=ABANDON_POLL_SECONDS)
            except concurrent.futures.CancelledError:  # given up by a checkpoint
                key = pending.key
                raise RoundFailed(key.fragment, key.round, "abandoned when saved") from None
            except concurrent.futures.TimeoutError:
                if self.should_abandon(pending.key):
                    pending.future.cancel()
                    key = pending.key
                    raise RoundFailed(key.fragment, key.round, "abandoned: stopping") from None

    def _apply(self, pending: PendingRound) -> AppliedRound:
        p = pending.key.fragment
        start = time.perf_counter()
        try:
            result = self._wait(pending)
            if result.withdrawn is not None and (reason := result.withdrawn()):
                raise RoundFailed(p, pending.key.round, reason)
            if reason := self.refuse(result):
                raise RoundFailed(p, pending.key.round, reason)
        except RoundFailed as error:
            blocked = time.perf_counter() - start
            self.failed_rounds += 1
            self.carried_weight[p] += pending.weight
            # Debug: a node tells failures by cause, sparingly (diloco.node.swarm.round_failures).
            logger.debug("%s: %s; keeping the outer state of fragment %d", self.member, error, p)
            return AppliedRound(pending.key, ok=False, blocked_seconds=blocked, error=str(error))
        blocked = time.perf_counter() - start
        state, prior = self.states[p], self.state_hash(p)
        if self.link is not None:
            self.link.wait_upload(p)  # the last upload must be done reading state.outer
        nesterov_step(
            state.outer,
            state.momentum,
            result.delta.to(state.outer.device),
            self.config.outer_lr,
            self.config.outer_momentum,
        )
        state.version = pending.key.round
        self.carried_weight[p] = 0.0
        self.hashes[p] = state.sha256()
        self._merge(p)
        return AppliedRound(
            pending.key,
            ok=True,
            members=result.members,
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
            seconds=result.seconds,
            matchmaking_seconds=result.matchmaking_seconds,
            blocked_seconds=blocked,
            outer_sha256=self.hashes[p],
            prior_sha256=prior,
            weight=pending.weight,
            member_weights=result.weights,
            round_trips=result.round_trips,
        )

    def _merge(self, p: int) -> None:
        """docs/design.md "Algorithm and schedule" step 5 for fragment ``p``: on the host for a CPU
        model (as ever), on the
        device after an asynchronous upload for a CUDA model."""
        outer, params = self.states[p].outer, self.fragments[p]
        if self.link is None:
            assign(params, merge(flatten(params), outer, self.alpha))
        else:
            self.link.merge(p, outer, params, self.alpha)

    def settle(self) -> None:
        """Wait for a CUDA model's queued copies and round starts (no-op on a CPU model):
        before the outer state is read whole, replaced, or saved."""
        if self.link is not None:
            self.link.settle()

    def adopt(self, fragment: int, state: FragmentState) -> None:
        """Take a peer's outer state of ``fragment`` (join or heal) and load it into theta.

        The weight carried from failed rounds goes: the adopted state already holds what
        those rounds would have brought. The inner optimizer state is kept (docs/design.md
        "Algorithm and schedule": it is never reset by a sync).

        Raises:
            ConfigError: the state's shape is not this fragment's.
        """
        mine = self.states[fragment]
        for name, theirs, ours in (
            ("outer", state.outer, mine.outer),
            ("momentum", state.momentum, mine.momentum),
        ):
            if theirs.shape != ours.shape:
                raise ConfigError(
                    f"fragment {fragment}: peer {name} has shape {tuple(theirs.shape)}"
                    f", expected {tuple(ours.shape)}"
                )
        self.settle()
        self.hashes.pop(fragment, None)
        mine.outer.copy_(state.outer)
        mine.momentum.copy_(state.momentum)
        mine.version = state.version
        self.carried_weight[fragment] = 0.0
        for pending in self.pending:  # failed already: the state adopted holds that round
            if pending.key.fragment == fragment and pending.failure() is not None:
                pending.weight = 0.0
        assign(self.fragments[fragment], mine.outer)

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self, timeout: float | None = None) -> dict[str, Any]:
        """Everything this replica's outer loop needs to continue exactly after a resume.

        Per fragment the outer tensors and version; the tokens counted toward each next
        round and the weight carried from failed ones; the rounds in flight, waited for (up
        to ``timeout``) and saved with their results. Waiting early changes nothing in the
        arithmetic: a result is applied at its receive step as before. The tensors are the
        live ones (torch's convention): save them before training on.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self.settle()
        return {
            "fragments": [
                {"outer": s.outer, "momentum": s.momentum, "version": s.version}
                for s in self.states
            ],
            "tokens_since_send": list(self.tokens_since_send),
            "carried_weight": list(self.carried_weight),
            "failed_rounds": self.failed_rounds,
            "pending": [self._saved_round(r, deadline) for r in self.pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict``; everything is checked before anything changes.

        Raises:
            ValueError: a state of other fragments (another model) or a malformed one.
        """
        try:
            fragments = state["fragments"]
            _require(len(fragments) == self.num_fragments, f"{len(fragments)} fragments")
            loaded = []
            for p, (saved, mine) in enumerate(zip(fragments, self.states, strict=True)):
                outer, momentum, version = saved["outer"], saved["momentum"], saved["version"]
                for x in (outer, momentum):
                    _require(
                        isinstance(x, torch.Tensor)
                        and x.dtype == torch.float32
                        and x.shape == mine.outer.shape,
                        f"fragment {p}: tensor of another shape or dtype",
                    )
                _require(_is_int(version) and version >= 0, f"fragment {p}: version {version!r}")
                loaded.append(FragmentState(outer, momentum, version))
            tokens = [float(x) for x in state["tokens_since_send"]]
            carried = [float(x) for x in state["carried_weight"]]
            _require(len(tokens) == len(carried) == self.num_fragments, "round weights")
            failed_rounds = int(state["failed_rounds"])
            pending = [self._restored_round(record) for record in state["pending"]]
        except (KeyError, TypeError, IndexError) as error:
            raise ValueError(f"malformed outer loop state: {error!r}") from error
        self.settle()
        self.hashes.clear()
        for mine, saved in zip(self.states, loaded, strict=True):
            mine.outer.copy_(saved.outer)
            mine.momentum.copy_(saved.momentum)
            mine.version = saved.version
        self.tokens_since_send, self.carried_weight = tokens, carried
        self.failed_rounds = failed_rounds
        self.pending = pending

    @staticmethod
    def _saved_round(pending: PendingRound, deadline: float | None) -> dict[str, Any]:
        """A round in flight as plain data, with its result once there (until ``deadline``)."""
        record: dict[str, Any] = {
            "fragment": pending.key.fragment,
            "round": pending.key.round,
            "receive_step": pending.receive_step,
            "weight": pending.weight,
        }
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            result = pending.future.result(timeout=left)
            record["result"] = {
                "delta": result.delta,
                "members": list(result.members),
                "bytes_sent": result.bytes_sent,
                "bytes_received": result.bytes_received,
                "seconds": result.seconds,
            }
        except RoundFailed as error:
            record["failed"] = error.reason
        except concurrent.futures.TimeoutError:
            pending.future.cancel()
            record["failed"] = "abandoned: still in flight when the checkpoint was taken"
        return record

    def _restored_round(self, record: dict[str, Any]) -> PendingRound:
        """A round saved by ``_saved_round``, as a completed future."""
        key = RoundKey(int(record["fragment"]), int(record["round"]))
        _require(0 <= key.fragment < self.num_fragments, f"pending fragment {key.fragment}")
        future: Future[RoundResult] = Future()
        if "result" in record:
            r = record["result"]
            delta = r["delta"]
            numel = self.states[key.fragment].outer.numel()
            _require(
                isinstance(delta, torch.Tensor) and delta.shape == (numel,),
                f"pending round {key}: result of another shape",
            )
            future.set_result(
                RoundResult(
                    delta=delta,
                    members=tuple(str(m) for m in r["members"]),
                    bytes_sent=int(r["bytes_sent"]),
                    bytes_received=int(r["bytes_received"]),
                    seconds=float(r["seconds"]),
                )
            )
        else:
            future.set_exception(RoundFailed(key.fragment, key.round, str(record["failed"])))
        return PendingRound(key, future, int(record["receive_step"]), float(record["weight"]))

    def load_outer_into(self, model_fragments: list[list[tuple[str, nn.Parameter]]]) -> None:
        """Copy every fragment's outer parameters into another model's fragments (eval)."""
        for state, params in zip(self.states, model_fragments, strict=True):
            assign(params, state.outer)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"invalid outer loop state: {what}")
