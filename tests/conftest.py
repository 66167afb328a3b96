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

    Known open bug (issue 3): on two busy cores a stream between peers is sometimes closed
    early (IncompleteReadError) in a round's fault paths, and that round fails for every
    member. A rerun must pass in full; a real regression fails all three tries.
    """
    for item in items:
        if item.get_closest_marker("swarm"):
            item.add_marker(pytest.mark.flaky(reruns=2, reruns_delay=2))
