"""How many sequences (rows) a node trains per inner step to keep the swarm's pace.

Nodes run on different hardware, and a fragment round needs its live members, so a node
slower per step than the others makes them wait at every round. The schedule is left alone
(every node does every inner step, sends at ``t_p + kH``, applies ``tau`` steps later);
what adapts is a slow node's batch. Each node publishes the seconds it would take for one
inner step with its full batch. A node counts only the claims of peers it has seen work
(rounds it applied with them) whose announced tokens agree with the claim
(``weigh_claims``); the pace is the *upper median* of those figures and its own
(``swarm_pace``), so keys that only write records count for nothing, and fewer than half
of the figures, however small, cannot set it (docs/design.md "Pace"). A node slower than
the pace trains fewer rows, about ``batch_size * pace / full_seconds`` a step on average (a
``share``, not a whole number: its steps alternate between the rows around it); its weight
in a round's mean is the tokens it actually trained, so its data still counts for what it is.

Step time is not linear in rows (a fixed cost per step), so a first guess from the linear
model misses; ``PaceController`` corrects it from the measured step time with a
multiplicative update, outside a tolerance band (hysteresis) so the share does not chase
every slow step.

Pure: no clock, no I/O; the trainer feeds it measured seconds and the claims it heard.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

PaceMode = Literal["adaptive", "fixed"]
"""``adaptive``: a node slower than the swarm's pace trains fewer rows per inner step;
``fixed``: every node trains its full batch (the swarm moves at its slowest node's pace)."""

RECENT_STEPS = 25
"""Steps whose median seconds per row a node goes by, for its share and for the full-batch
figure it publishes. On 2 shared cores a node's steps are quick while its peers wait in a
round and slow while they compute: over 5 steps the published figures of nodes at 0.13-0.14 s
a step ranged 0.08-0.19 s, the pace with them, and a node was cut by a quarter of its rows
at random. 25 steps (a few seconds) span those phases; a real change moves the median
within 13. Seconds per row stay comparable across a change of share, so the window is not
emptied by one."""
TOLERANCE = 0.05
"""Relative band around the pace in which the share is left as it is (hysteresis). A node
this much slower than the pace at its full batch keeps it, and its peers wait that much for
it at every round; a share in fractions of a row can follow the pace this closely, where
whole rows of a batch of 8 moved a node by 12.5% at a time."""
SETTLE_STEPS = 3
"""Steps measured, and steps since the share last changed, before it may change (again)."""
WARN_RATIO = 1.5
"""A node at its fewest rows and this many times slower than the pace is told so."""
ROUNDING = 1e-9
"""Rows a sum of shares may miss by rounding and still count as whole (3.33 + 0.67 is 4)."""


RECENT_ROUNDS = 3
"""A peer's newest witnessed rounds whose weights (median) give its rows per step."""
ROWS_BAND = 2.0
"""A claim agrees with a peer's tokens when the rows it implies and the rows its weights
show are within this factor of each other, give or take one row (both are floored)."""


def swarm_pace(step_seconds: Iterable[float]) -> float | None:
    """The upper median of the counted full-batch step seconds (None: no figures).

    With ``n`` figures it is the ``n // 2``-th smallest: made-up small figures set it only
    if they are more than half of those counted; with an even count (a pair of one honest
    node and one liar) the slower middle one wins, so a liar claiming to be fast never
    shrinks its partner's rows. Made-up large figures fewer than half leave it at an
    honest one.
    """
    ordered = sorted(step_seconds)
    return ordered[len(ordered) // 2] if ordered else None


@dataclass(frozen=True, slots=True)
class Evidence:
    """The peers' pace claims a node counts, and why it ignores the others."""

    counted: dict[str, float]
    """Peer -> its claimed full-batch step seconds, backed by its witnessed tokens."""
    ignored: dict[str, str]
    """Peer -> why its claim does not count."""


def weigh_claims(
    claims: Mapping[str, float],
    worked: Mapping[str, Sequence[float]],
    own_seconds: float | None,
    batch_size: int,
    round_tokens_per_row: float,
) -> Evidence:
    """Which peers' claimed step seconds count towards this node's pace.

    ``claims``: the other live nodes' published full-batch seconds; ``worked``: each
    peer's announced weights (tokens) in the rounds this node applied with it, oldest
    first (``Witness.weights``); ``round_tokens_per_row``: the tokens one row per step
    adds to a round (``seq_len * H``). A claim counts only when the peer worked with this
    node and its newest weights show about the rows the claim implies at the pace of the
    witnessed claims and this node's own figure: ``target_rows(batch_size, pace, s)``,
    with this node's batch as the reference (the swarm's nodes share it).
    """
    counted: dict[str, float] = {}
    ignored: dict[str, str] = {}
    witnessed = {peer: s for peer, s in claims.items() if worked.get(peer)}
    for peer in claims.keys() - witnessed.keys():
        ignored[peer] = "no round with this node"
    own = [] if own_seconds is None else [own_seconds]
    pace = swarm_pace([*witnessed.values(), *own])
    if pace is None:
        return Evidence(counted, ignored)
    for peer, seconds in witnessed.items():
        shown = statistics.median(worked[peer][-RECENT_ROUNDS:]) / round_tokens_per_row
        implied = target_rows(batch_size, pace, seconds)
        if max(shown, implied) <= ROWS_BAND * min(shown, implied) + 1:
            counted[peer] = seconds
        else:
            ignored[peer] = (
                f"claims {seconds:.3g} s per step, i.e. {implied} rows at the pace "
                f"{pace:.3g} s, but its rounds show {shown:.2f} rows per step"
            )
    return Evidence(counted, ignored)


def target_rows(batch_size: int, pace: float, full_seconds: float, min_rows: int = 1) -> int:
    """Rows that make a node taking ``full_seconds`` per full batch step in ``pace``
    seconds, if step time were proportional to rows: ``floor(batch_size * pace /
    full_seconds)`` within ``[min_rows, batch_size]`` (never more than the full batch,
    which is what fits the node's memory)."""
    rows = math.floor(batch_size * pace / full_seconds)
    return max(min_rows, min(batch_size, rows))


@dataclass(slots=True)
class PaceController:
    """One node's rows per inner step, from its measured step seconds and the swarm's pace.

    ``observe`` takes the seconds of each inner step (compute, and any deliberate
    slow-down: it models a slower device) at the current ``rows``; ``full_seconds`` is the
    node's estimate for its full batch, which it publishes. The node aims at ``share`` rows a
    step, a fraction: each step trains the whole rows that keep the sum of its rows within
    one of ``share`` times its steps (error diffusion: a share of 7.6 trains 7, 8, 7, 8, 8,
    ...), so over the ``H`` steps between two rounds it takes the time of the pace.
    """

    batch_size: int
    min_rows: int = 1
    share: float = field(init=False)
    """Rows a step on average, in ``[min_rows, batch_size]``."""
    rows: int = field(init=False)
    """Rows of the next step."""
    carry: float = field(init=False, default=0.0)
    """The fraction of a row the rows so far fell short of the share (0 to 1, give or take
    ``ROUNDING``)."""
    recent: list[float] = field(init=False, default_factory=list)
    """Seconds per row of the last ``RECENT_STEPS`` steps, oldest first."""
    settled: int = field(init=False, default=0)
    """Steps since the share last changed."""

    pace: float | None = field(init=False, default=None)
    """The swarm's pace at the last step, in seconds (None: ``fixed`` mode)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_rows <= self.batch_size:
            raise ValueError(f"min_rows {self.min_rows} not in [1, {self.batch_size}]")
        self.share = float(self.batch_size)
        self.rows = self.batch_size

    def observe(self, seconds: float, peers: Sequence[float] | None) -> int:
        """Count one step of ``seconds`` at the current rows; returns the rows for the next
        step. ``peers`` are the other live nodes' full-batch step seconds: with this node's
        own current figure (never a stale published copy: a node that is the median, or
        alone, is the pace and keeps its full batch) they give ``pace``. None (``fixed``
        mode) means the full batch."""
        self.recent = [*self.recent[-(RECENT_STEPS - 1) :], seconds / self.rows]
        self.settled += 1  # never more than the steps in ``recent``: it is never emptied
        per_row = statistics.median(self.recent)
        pace = None if peers is None else swarm_pace([*peers, per_row * self.batch_size])
        self.pace = pace
        if pace is None:
            self._set(float(self.batch_size))
        elif self.settled >= SETTLE_STEPS:
            at_share = per_row * self.share
            self._set(next_share(self.share, at_share, pace, self.batch_size, self.min_rows))
        owed = self.share + self.carry
        self.rows = math.floor(owed + ROUNDING)
        self.carry = owed - self.rows
        return self.rows

    def slower_than_pace(self, pace: float | None) -> float | None:
        """How many times slower than ``pace`` the node still is at its fewest rows, when
        that is at least ``WARN_RATIO`` (None otherwise): it holds the swarm back."""
        seconds = self.seconds
        if pace is None or seconds is None or self.share > self.min_rows:
            return None
        ratio = seconds / pace
        return ratio if ratio >= WARN_RATIO else None

    @property
    def full_seconds(self) -> float | None:
        """Estimated seconds of a full-batch step (published): the median seconds per row of
        ``recent`` times the batch (an over-estimate for a reduced node when a step has a
        fixed cost, which only ever places it further from the median); None: no step yet."""
        return statistics.median(self.recent) * self.batch_size if self.recent else None

    @property
    def seconds(self) -> float | None:
        """Median step seconds at the current share, from ``recent`` (None: no step yet)."""
        return statistics.median(self.recent) * self.share if self.recent else None

    def _set(self, share: float) -> None:
        if share != self.share:
            self.share, self.settled = share, 0


def next_share(
    share: float, seconds: float, pace: float, batch_size: int, min_rows: int = 1
) -> float:
    """The share after steps of ``seconds`` (median) at ``share`` rows against ``pace``:
    unchanged within ``TOLERANCE`` of the pace, else scaled by ``pace / seconds``, within
    ``[min_rows, batch_size]``.

    Not rounded: whole rows floored made a node err early by up to a row, and early, it
    reached every send step first and waited for its peers. At 3 nodes and 200 ms the run's
    creator, 4-9% slower per row than the others, was cut from 8 rows to 7 or 6 and lost
    5-11 points of compute utilisation so (docs/design.md "Pace"). The linear scaling
    misses a step's fixed cost; the next measurement corrects it."""
    if abs(seconds - pace) <= TOLERANCE * pace:
        return share
    return max(float(min_rows), min(float(batch_size), share * pace / seconds))
