"""Suite-wide settings.

One torch thread per process: the suite runs several processes at once (swarm peers) on
two cores, and OpenMP worker threads spinning on oversubscribed cores slow every step many
times over.
"""

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Multi-process swarm tests get up to two reruns.

    Issue 3, still open: on two busy cores a libp2p stream between peers is sometimes
    closed under a round (both ends see it end; none of our close paths ran). The protocol
    now opens a cut JOIN, PART or REPORT stream once more, so such a cut no longer fails the
    round (it used to fail it for every member); its cause is not found. A rerun must pass
    in full; a real regression fails all three tries.
    """
    for item in items:
        if item.get_closest_marker("swarm"):
            item.add_marker(pytest.mark.flaky(reruns=2, reruns_delay=2))
