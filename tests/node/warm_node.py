"""A `diloco-node` process started before its node is needed (for the swarm tests).

Importing the node (torch, hivemind, the package) takes about 2 s of CPU: several seconds of
wall time on two loaded cores, spent while the rest of a swarm test waits for the node. A
test that starts a node later on (a joiner once the first node printed its address, or once
a hostile peer stored its lies) starts this program early instead: it imports the
node at once, then reads the node's command line from stdin and runs it, as
``python -m diloco ARGS`` would. The node still starts when the test says; it just starts
sooner.

Run as ``python warm_node.py``; on the test's side, ``WarmNode`` starts it and ``go`` gives
it its arguments (a test that ends first kills it with ``stop``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_swarm_node import Node


class WarmNode(Node):
    """A node whose process starts now and whose command line comes later (``go``)."""

    def __init__(self, name: str, folder: Path) -> None:
        self.name = name
        self.log = folder / f"{name}.log"
        self.metrics = folder / f"{name}.jsonl"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, __file__],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                text=True,
            )

    def go(self, args: list[str]) -> WarmNode:
        """Run ``diloco-node ARGS --metrics-out FILE`` in the waiting process."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps([*args, "--metrics-out", str(self.metrics)]) + "\n")
        self.process.stdin.close()
        return self


def main() -> None:
    from diloco.cli import main as diloco_node
    from diloco.node.swarm import node, pinned_run  # noqa: F401  (what start and join import)

    line = sys.stdin.readline()
    if line:  # else the test ended before it needed the node
        diloco_node(json.loads(line), prog_name="diloco-node")


if __name__ == "__main__":
    main()
