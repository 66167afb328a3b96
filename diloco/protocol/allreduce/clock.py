"""The clock of a round's timers at this node: when a member dropped as silent is charged
(``silence``), when a finished round stops answering checks and is forgotten
(``routing``). By default the running event loop's; a test passes one that it moves past
those deadlines at once instead of sleeping until them (docs/design.md "The round")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Clock(Protocol):
    """Loop time and a timer on it (``asyncio.AbstractEventLoop`` is one)."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> object: ...
