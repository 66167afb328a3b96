"""A process's bounded memory of checks that passed, shared by its threads.

The DHT hands the same records back again and again (docs/design.md "Wire formats"), so a
node verifies the same signatures and checks the same records many times over. What passed
is remembered, by exactly what was checked, and not checked again; what failed is not
remembered, so a bad signature or record costs its checker every time and cannot crowd out
good ones. The oldest entries go first once ``size`` are held.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Hashable


class Remembered:
    """The last ``size`` keys added, most recently met last; thread-safe, fork-safe."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = threading.Lock()
        # A child forked while another thread held the lock (a node forks its DHT process
        # with its threads running) starts with a free one: its copy would stay locked.
        os.register_at_fork(after_in_child=self._unlock)

    def _unlock(self) -> None:
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` was added and not yet forgotten (meeting it keeps it longer)."""
        with self._lock:
            if key in self._keys:
                self._keys.move_to_end(key)
                return True
            return False

    def add(self, key: Hashable) -> None:
        with self._lock:
            self._keys[key] = None
            while len(self._keys) > self.size:
                self._keys.popitem(last=False)

    def __len__(self) -> int:
        return len(self._keys)
