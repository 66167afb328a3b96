"""What ``start`` and ``join`` check before a node starts, each failure one line that says
the fix: the ports it is to listen on, and its checkpoint folder (writable, and with
``--resume`` holding a checkpoint of this run)."""

from __future__ import annotations

import errno
import re
import socket
from typing import Any

from diloco.errors import ConfigError
from diloco.node.config import RunConfig
from diloco.node.flags import RUN_FLAGS, TAU_PATH
from diloco.node.training.checkpoint import CheckpointManager, check_folder, saved_run
from diloco.protocol.records.run_info import peer_id_in
from diloco.protocol.runtime.network import NetworkOptions

_PEER_ADDRESS = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/[^/]+/(tcp|udp)/\d+(/.*)?$")


def check_peer_addresses(addresses: tuple[str, ...]) -> None:
    """Each ``--initial-peers`` address is a whole multiaddr with a peer id, the form a node
    prints, checked before anything starts so that a mistyped one is one clear line.

    Raises:
        ConfigError: the first bad address, and the form expected.
    """
    for address in addresses:
        try:
            if not _PEER_ADDRESS.match(address) or "/p2p/" not in address:
                raise ConfigError("not a multiaddr")
            peer_id_in(address)
        except ConfigError as error:
            raise ConfigError(
                f"bad --initial-peers address {address!r}: expected "
                "/ip4/HOST/tcp/PORT/p2p/PEERID, as a running node prints it"
                + ("" if str(error) == "not a multiaddr" else f"; {str(error).split(': ')[-1]}")
            ) from error


def check_ports(net: NetworkOptions) -> None:
    """Every TCP port named in ``--listen`` is free (0: any free one is).

    p2pd binds with SO_REUSEPORT, so a second node on a port in use would share it with
    the first, silently, and peers would reach either. A socket of our own, with
    SO_REUSEADDR (a port left in TIME_WAIT by a node just stopped is free) but without
    SO_REUSEPORT, cannot bind a port some process listens on.

    Raises:
        ConfigError: a port is in use (which address, and the fix).
    """
    for addr in net.host_maddrs:
        parts = addr.split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
            continue
        host, port = parts[2], int(parts[4]) if parts[4].isdigit() else 0
        if port == 0:
            continue
        family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    continue  # p2pd will say what is wrong with the address itself
                raise ConfigError(
                    f"--listen {addr}: port {port} is in use (another node?); choose another "
                    "port, or tcp/0 for any free one"
                ) from error


def check_checkpoints(folder: str | None, resume: bool, run: RunConfig | None, whose: str) -> None:
    """``--checkpoint-dir`` can be written, and with ``--resume`` holds a checkpoint of
    ``run`` (the run of the command line, ``whose`` "yours", or the swarm's; None: not
    known yet): found before the node starts, never at its first save, and never a new
    run where a resume was asked for.

    Raises:
        ConfigError: ``--resume`` without a checkpoint to continue, or one of another run
            (naming each differing setting by its flag).
        CheckpointError: the folder cannot be written.
    """
    if resume and folder is None:
        raise ConfigError("--resume needs --checkpoint-dir, the folder of the run's checkpoints")
    if folder is None:
        return
    if resume and not CheckpointManager(folder).checkpoints():  # before check_folder makes it
        raise ConfigError(
            f"--resume: no checkpoint in {folder} (no step_* folder): check the path, or drop "
            "--resume to start a new run"
        )
    found = saved_run(folder) if resume and run is not None else None
    if found is not None and run is not None:
        path, saved = found
        diffs = run_differences(saved, run.to_dict(), whose)
        if diffs:
            raise ConfigError(
                f"--resume: checkpoint {path} belongs to another run configuration: "
                + "; ".join(diffs)
                + " (resume with the run's settings)"
            )
    check_folder(folder)


def run_differences(saved: dict[str, Any], mine: dict[str, Any], whose: str) -> list[str]:
    """Each setting in which two run configurations differ, by its flag (``--H: checkpoint
    10, yours 5``) or, without one, its key in a run's TOML file. The creator is left out:
    ``start`` learns it from its identity later, and the trainer names that case itself."""
    names = {flag.path: flag.name for flag in RUN_FLAGS.flags}
    names[TAU_PATH] = "--tau"

    def flat(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
        out: dict[tuple[str, ...], Any] = {}
        for key, value in data.items():
            if isinstance(value, dict):
                out |= flat(value, (*prefix, key))
            else:
                out[(*prefix, key)] = value
        return out

    a, b = flat(saved), flat(mine)
    return [
        f"{names.get(path, '.'.join(path))}: checkpoint {a.get(path)!r}, {whose} {b.get(path)!r}"
        for path in sorted(a.keys() | b.keys())
        if path != ("creator",) and a.get(path) != b.get(path)
    ]
