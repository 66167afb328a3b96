"""Heterogeneous pace (docs/design.md "Pace"): three `diloco-node` processes, node c slowed on
purpose (``--slow-down 3``: each of its inner steps takes 3x its compute, a slower device
whatever the machine's load). With ``--pace adaptive`` (the default) c trains fewer
sequences per step, so the swarm keeps the fast nodes' pace; c's tokens still count, with
their weight in the rounds' means, and the three keep meeting in full rounds.

The batch (8 x 128 tokens) is big enough that a step's compute scales with its rows on one
CPU thread (the micro preset: about 0.017 s at 1 row, 0.064 s at 8 here), else fewer rows
would not help. How much of the fast nodes' time that saves (their blocked share, about 2/3
in lock-step) is a speed figure, measured by ``benchmarks/pace.py``, not asserted here.
"""

from __future__ import annotations

import os
import statistics

import pytest
from test_swarm_node import listen, nodes  # noqa: F401  (the fixture)

pytestmark = pytest.mark.swarm

STEPS, H, BATCH, SEQ_LEN = 90, 20, 8, 128
COMMON = [
    "--preset", "micro", "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--threads", "1",
    "--log-every", "40", "--tau", "1",
]  # fmt: skip
"""tau pinned to 1 (not auto): lock-step at every round is what ``fixed`` pace is measured
against, and auto's overlap would hide part of the blocking either way."""
PACE = ["--pace", os.environ.get("DILOCO_TEST_PACE", "adaptive")]
"""Every node's pace; ``DILOCO_TEST_PACE=fixed`` (lock-step, every node its full batch)
makes the rows and weights assertions fail."""


def test_fast_nodes_keep_their_pace_and_the_slow_nodes_tokens_count(nodes, tmp_path) -> None:  # noqa: F811
    run = ["--name", "pace", "--steps", str(STEPS), "--H", str(H)]
    # All three start at step 0 (each waits for the two others), so every step counts.
    wait = ["--wait-for-peers", "2"]
    a = nodes("a", ["start", *run, *COMMON, *PACE, *wait, *listen(2), "--data-seed", "0"])
    join = ["join", "--initial-peers", a.address(), *COMMON, *PACE, *wait]
    b = nodes("b", [*join, *listen(3), "--data-seed", "1"])
    c = nodes("c", [*join, *listen(4), "--data-seed", "2", "--slow-down", "3"])
    for node in (a, b, c):
        assert node.process.wait(600) == 0, node.output()
    rounds = {n.name: [r for r in n.records() if r["event"] == "round"] for n in (a, b, c)}
    # All three present: from c's first round with three members.
    first = min(r["step"] for r in rounds["c"] if r["members"] == 3)
    late = {name: [r for r in rs if first <= r["step"] <= STEPS - H] for name, rs in rounds.items()}

    # c trained fewer rows than its batch once it knew the pace (from its next steps on,
    # at 1-2 rows; the median leaves out the steps it may train alone at the end, when a
    # loaded machine let it meet the others late) ...
    c_rows = [r["rows"] for r in c.records() if r["event"] == "step" and r["step"] > first]
    assert c_rows and statistics.median(c_rows) < BATCH, c_rows
    summary = c.summary()
    assert summary["rows_trained"] < BATCH * STEPS
    # ... and its tokens are in the means: its rounds with all three members weigh what it
    # trained, fewer tokens than a full batch's H steps (each fragment's rounds count every
    # token once, so fragment 0's weights add up to at most what it trained).
    c_weights = [r["weight"] for r in rounds["c"] if r["members"] == 3]
    assert c_weights and min(c_weights) < H * BATCH * SEQ_LEN, c_weights
    fragment_0 = [r["weight"] for r in rounds["c"] if r["fragment"] == 0]
    assert 0 < sum(fragment_0) <= summary["tokens_trained"]
    # Most rounds had all three members once they were present.
    for name in "abc":
        assert 2 * sum(r["members"] == 3 for r in late[name]) >= len(late[name]) > 0, name
