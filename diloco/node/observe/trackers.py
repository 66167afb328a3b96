"""A node's curves in Weights & Biases (``--wandb-project``) or TensorBoard
(``--tensorboard-dir``), made from the node's own events like its Prometheus metrics.

Both packages are optional extras (``pip install 'diloco-node[wandb]'``, ``[tensorboard]``),
imported only when their flag is given; a missing one is a one-line ``ConfigError``. Each
node is one W&B run (grouped by the swarm's run id) or one TensorBoard run (a folder named
by its short peer id under the directory given), so the nodes of a swarm appear side by
side. ``WANDB_MODE=offline`` keeps W&B on this machine (``wandb sync`` uploads later).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from diloco.errors import ConfigError

SCALARS = {
    "progress": {
        "loss": "train/loss",
        "tokens_per_s": "train/tokens_per_s",
        "cu": "train/compute_utilisation",
        "mb_sent": "network/mb_sent",
        "mb_received": "network/mb_received",
        "peers_last_round": "swarm/peers_last_round",
        "tau": "swarm/tau",
    },
    "eval": {"loss_outer": "eval/loss_outer"},
    "round": {"seconds": "rounds/seconds", "members": "rounds/members"},
    "summary": {"eval_loss": "eval/loss_outer_final", "eval_loss_local": "eval/loss_local_final"},
}
"""Per event kind: which of its fields are curves, under which names (step: its ``step``)."""


class Tracker(Protocol):
    """Something that takes every node event and is closed once."""

    def observe(self, event: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class Curves:
    """Turns events into curve values; counts failed rounds into a curve of its own."""

    def __init__(self) -> None:
        self.failed_rounds = 0

    def __call__(self, event: Mapping[str, Any]) -> dict[str, float]:
        """The curves' values in one event (none for other kinds or non-numeric fields)."""
        names = SCALARS.get(str(event.get("event")), {})
        values = {
            name: float(event[key])
            for key, name in names.items()
            if isinstance(event.get(key), int | float) and not isinstance(event.get(key), bool)
        }
        if event.get("event") == "round_failed":
            self.failed_rounds += 1
            values["rounds/failed"] = float(self.failed_rounds)
        return values


def short_peer(peer_id: str) -> str:
    """The last 8 characters of a peer id: enough to tell a swarm's nodes apart."""
    return peer_id[-8:]


def _require(module: str, flag: str, extra: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(
            f"{flag} needs the {extra} package: pip install 'diloco-node[{extra}]'"
        ) from error


def check_available(wandb_project: str | None, tensorboard_dir: str | None) -> None:
    """Before a node starts: the packages its tracking flags need are installed.

    Raises:
        ConfigError: one is missing (one line naming the extra to install).
    """
    if wandb_project:
        _require("wandb", "--wandb-project", "wandb")
    if tensorboard_dir:
        _require("tensorboard", "--tensorboard-dir", "tensorboard")


class WandbTracker:
    """One W&B run per node: name = short peer id, group = the swarm's run id."""

    def __init__(self, project: str, run_id: str, peer_id: str, config: Mapping[str, Any]) -> None:
        self.wandb = wandb = _require("wandb", "--wandb-project", "wandb")
        self.curves = Curves()
        self.run = wandb.init(
            project=project,
            group=run_id,
            name=short_peer(peer_id),
            config={"run_id": run_id, "peer_id": peer_id, **config},
            settings=wandb.Settings(console="off"),  # the node's terminal stays as it is
        )

    def observe(self, event: Mapping[str, Any]) -> None:
        values = self.curves(event)
        if values and isinstance(event.get("step"), int):
            self.run.log(values, step=event["step"])

    def close(self) -> None:
        """Finish the run, then stop W&B's service process: only then is an offline run's
        file complete on disk (``finish`` alone may return before it is written)."""
        self.run.finish()
        self.wandb.teardown()


class TensorboardTracker:
    """Event files under ``folder/<short peer id>``: one TensorBoard run per node."""

    def __init__(self, folder: str | Path, peer_id: str) -> None:
        _require("tensorboard", "--tensorboard-dir", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(folder) / short_peer(peer_id)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self.curves = Curves()

    def observe(self, event: Mapping[str, Any]) -> None:
        values = self.curves(event)
        step = event.get("step")
        if isinstance(step, int):
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()
