"""How a node reaches the swarm: the network options of its DHT and p2pd, as one record.

The node builds ``NetworkOptions`` from its flags (docs/design.md "The node and its CLI": listen and
announce addresses, identity file, relay options, a closed swarm's key file) and hands it
whole to ``Swarm``, which hands it whole to ``make_dht``. Nothing probes the local router
unless asked: NAT port mapping, AutoNAT and relays are off by default. A node that nobody
can dial (behind NAT) is a *client*: it trains with the swarm but reduces no part; it finds
out by itself (``reachability``) or is told so (``client_mode``).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.errors import ConfigError

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkOptions:
    """This node's way into the swarm (local choices: never part of the run id)."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of running nodes to bootstrap from; empty for the first node."""
    host_maddrs: tuple[str, ...] = (LOOPBACK,)
    """Multiaddrs to listen on; loopback by default (``/ip4/0.0.0.0/tcp/PORT`` for others)."""
    announce_maddrs: tuple[str, ...] = ()
    """Public multiaddrs announced instead of the listening ones (port forwarding)."""
    identity_path: str | None = None
    """Private key file for a stable peer id (created if missing); None: a new id per start."""
    use_relay: bool = False
    """Reach and be reached through libp2p relays (peers behind NAT)."""
    nat_port_map: bool = False
    """Ask the router for a port mapping (UPnP)."""
    auto_nat: bool = False
    """Ask peers whether this node is reachable (AutoNAT)."""
    client_mode: bool = False
    """Take no reducer part and never lead a round, and run the DHT as a client (hivemind's
    ``client_mode``: it serves no DHT requests); for a node nobody can dial. Without it a
    joining node asks its initial peers to dial it back and becomes a client if none can."""
    swarm_key_path: str | None = None
    """Closed swarms: the file holding the run's shared key (``diloco-node keygen``);
    None: an open swarm."""
    startup_timeout: float = 60.0
    """Seconds to wait for the DHT process and its p2pd to start."""
    transfer_timeout_factor: float = 4.0
    """Part deadlines of a round: this many times the 90th percentile of recent rounds'
    transfer times (``adaptive``), at most the run's timeouts; 0: always the run's."""
    min_transfer_timeout: float = 5.0
    """Seconds: the least the part deadlines of a round adapt down to (``adaptive``); a
    busy host's scheduling stalls stay under it."""

    def __post_init__(self) -> None:
        for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(
                isinstance(a, str) and a.startswith("/") for a in value
            ):
                raise ConfigError(
                    f"{name} must be a tuple of multiaddrs like /ip4/1.2.3.4/tcp/31337, "
                    f"got {value!r}"
                )
        if not self.host_maddrs:
            raise ConfigError(f"a node needs an address to listen on, e.g. --listen {LOOPBACK}")
        if not (self.transfer_timeout_factor >= 0 and self.min_transfer_timeout > 0):
            raise ConfigError(
                "transfer_timeout_factor must be >= 0 and min_transfer_timeout > 0 s, got "
                f"{self.transfer_timeout_factor} and {self.min_transfer_timeout}"
            )
        if not self.startup_timeout > 0:
            raise ConfigError(f"startup_timeout must be > 0 s, got {self.startup_timeout}")
