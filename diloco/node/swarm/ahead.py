"""Which rounds a node announces before their send step (docs/design.md "Across the
internet"): the next round of every fragment with no round in flight.

A fragment's next round starts from the state its previous round left, so once that round
was applied (or failed) the prior is known, ``H - tau`` steps or so before the send; the
reducer may then declare and read the round (``Reducer.prepare``) while the node trains,
and the send step finds the group's view ready. Healing may still change the prior before
the send: the round is announced again with the new one (a node that missed a round heals
right after, and would otherwise declare late at every send step, and miss every round).
A fragment that lacks its last round is not announced until it is healed: its prior is
likely not the swarm's (``before_send``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.node.model.fragments import next_send_step, send_round, send_step
from diloco.node.training.outer import FragmentSync
from diloco.protocol.core.reducer import Reducer, RoundKey

LEAD_MARGIN_S = 1.0
"""Seconds added to a round's estimated lead: its declaration must outlive a slow stretch."""


@dataclass
class Announcer:
    """Tells ``reducer`` of each fragment's next round once, as soon as it can."""

    reducer: Reducer
    announced: dict[int, tuple[int, str]] = field(default_factory=dict)
    """Fragment -> the last round announced for it, and the prior announced."""

    def announce(
        self,
        sync: FragmentSync,
        step: int,
        last_step: int,
        tokens_per_step: float,
        step_seconds: float,
    ) -> list[RoundKey]:
        """After ``step``: announce the next round, sent by ``last_step``, of each fragment
        without a round in flight (again if its prior changed since), with its weight as it
        will be if every step until the send trains ``tokens_per_step`` tokens, and its lead
        as twice ``step_seconds`` (this step's wall time) per step until then, plus a
        margin. Returns the rounds announced."""
        h, fragments = sync.config.sync_every, sync.num_fragments
        busy = {pending.key.fragment for pending in sync.pending}
        keys = []
        for p in range(fragments):
            send = next_send_step(step + 1, p, h, fragments)
            k = send_round(send, p, h, fragments)
            if p in busy or k is None or send > last_step:
                continue
            if sync.states[p].version < k - 1:
                # Round k - 1 failed for us or we skipped it: our prior is likely stale, and
                # its declaration would end the peers' wait (they wait for every live node
                # to declare) before the heal that precedes the send (``before_send``).
                continue
            prior = sync.state_hash(p)  # again after a heal: the round declares it anew
            if self.announced.get(p) == (k, prior):
                continue
            self.announced[p] = (k, prior)
            steps = send - step
            weight = sync.tokens_since_send[p] + sync.carried_weight[p]
            weight += steps * tokens_per_step
            lead = 2 * steps * step_seconds + LEAD_MARGIN_S
            numel = sync.states[p].outer.numel()
            self.reducer.prepare(RoundKey(p, k), numel, weight, prior, lead)
            keys.append(RoundKey(p, k))
        return keys

    def skipped(self, sync: FragmentSync, after: int, upto: int) -> list[RoundKey]:
        """The node moved from step ``after`` to ``upto`` without training the steps between
        (it caught up with the swarm): the rounds it announced whose send steps it skipped
        go on without it, and the reducer tells the peers waiting for it
        (``Reducer.forgo``). Returns those rounds."""
        h, fragments = sync.config.sync_every, sync.num_fragments
        keys = [
            RoundKey(p, k)
            for p, (k, _) in sorted(self.announced.items())
            if after < send_step(p, k, h, fragments) <= upto
        ]
        for key in keys:
            self.reducer.forgo(key)
        return keys
