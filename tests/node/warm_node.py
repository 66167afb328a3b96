"""The program of a `diloco-node` process started before its node is needed (the swarm
tests' ``WarmNode``, in ``test_swarm_node.py``).

Importing the node (torch, hivemind, the package) takes about 2 s of CPU: several seconds of
wall time on two loaded cores, spent while the rest of a swarm test waits for the node. A
test that starts a node later on (a joiner once the first node printed its address, or once
a hostile peer stored its lies) starts this program early instead: it imports the node at
once, then reads the node's command line from stdin and runs it, as ``python -m diloco
ARGS`` would. The node still starts when the test says; it just starts sooner. Stdin closed
without a line (the test ended first): it exits.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from diloco.cli import main as diloco_node
    from diloco.node.swarm import node, pinned_run  # noqa: F401  (what start and join import)

    line = sys.stdin.readline()
    if line:  # else the test ended before it needed the node
        diloco_node(json.loads(line), prog_name="diloco-node")


if __name__ == "__main__":
    main()
