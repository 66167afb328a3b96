"""Prometheus metrics of a node (``--prometheus-port``), made from the node's own events.

``NodeMetrics.observe`` consumes the events the node emits (as ``on_event``, next to the
progress lines), so the training loop knows nothing of Prometheus. Exposed at
``http://HOST:PORT/metrics`` in the text format (``prometheus_client``), one registry per
node (never the process-wide default, so several nodes in one process stay apart):

    diloco_steps_total                       inner steps trained by this process
    diloco_tokens_total                      tokens trained on
    diloco_global_step                       the node's global step
    diloco_loss                              training loss (mean of the last progress interval)
    diloco_eval_loss_outer                   held-out loss of the outer weights (--eval-every)
    diloco_compute_utilisation_ratio         share of wall time not blocked on the network
    diloco_bytes_sent_total                  all-reduce bytes sent (counted on our streams)
    diloco_bytes_received_total              all-reduce bytes received
    diloco_rounds_total{outcome="ok|failed"} fragment rounds by outcome
    diloco_round_seconds                     histogram: matchmaking + all-reduce of ok rounds
    diloco_heal_events_total                 state downloads that healed fragments
    diloco_healed_fragments_total            fragments adopted from peers by healing
    diloco_peers_last_round                  members of the last successful round
    diloco_node_info{run_id,peer_id,codec}   1
    process_*                                CPU seconds, memory, open files of the process

Names follow Prometheus' conventions: ``_total`` for counters, ``_ratio`` for a share in
[0, 1]; no since-start rate (``rate(diloco_tokens_total[1m])`` is the throughput now).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.exposition import start_http_server

ROUND_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Round durations span loopback (a tenth of a second) to slow links (minutes)."""


class NodeMetrics:
    """The node's metrics in their own registry; ``serve`` exposes them over HTTP."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tokens_per_step = 0
        self.steps = Counter("diloco_steps", "Inner steps trained by this process", registry=r)
        self.tokens = Counter("diloco_tokens", "Tokens trained on by this process", registry=r)
        self.global_step = Gauge("diloco_global_step", "The node's global step", registry=r)
        self.loss = Gauge("diloco_loss", "Training loss, mean of a progress interval", registry=r)
        self.eval_loss = Gauge(
            "diloco_eval_loss_outer", "Held-out loss of the outer weights", registry=r
        )
        self.cu = Gauge(
            "diloco_compute_utilisation_ratio",
            "Share of wall time not blocked on the network (0..1)",
            registry=r,
        )
        self.bytes_sent = Counter(
            "diloco_bytes_sent", "All-reduce bytes sent (our streams)", registry=r
        )
        self.bytes_received = Counter(
            "diloco_bytes_received", "All-reduce bytes received (our streams)", registry=r
        )
        self.rounds = Counter(
            "diloco_rounds", "Fragment rounds by outcome", ["outcome"], registry=r
        )
        for outcome in ("ok", "failed"):  # both series exist from the start, at 0
            self.rounds.labels(outcome=outcome)
        self.round_seconds = Histogram(
            "diloco_round_seconds",
            "Seconds of a successful round (matchmaking and all-reduce)",
            buckets=ROUND_SECONDS_BUCKETS,
            registry=r,
        )
        self.heals = Counter("diloco_heal_events", "Healing state downloads", registry=r)
        self.healed = Counter(
            "diloco_healed_fragments", "Fragments adopted from peers by healing", registry=r
        )
        self.peers = Gauge(
            "diloco_peers_last_round", "Members of the last successful round", registry=r
        )
        self.info = Info("diloco_node", "Run and peer of this node", registry=r)
        ProcessCollector(registry=r)
        self.server: Any = None

    def observe(self, event: Mapping[str, Any]) -> None:
        """Account one node event; events of other kinds are ignored."""
        kind = event.get("event")
        if "step" in event and isinstance(event["step"], int):
            self.global_step.set(event["step"])
        if kind == "config":
            self.tokens_per_step = int(event.get("tokens_per_step", 0))
            self.info.info({k: str(event[k]) for k in ("run_id", "peer_id", "codec") if k in event})
        elif kind == "step":
            self.steps.inc()
            self.tokens.inc(self.tokens_per_step)
        elif kind == "progress":
            self.loss.set(event["loss"])
            self.cu.set(event["cu"])
        elif kind == "eval":
            self.eval_loss.set(event["loss_outer"])
        elif kind == "round":
            self.rounds.labels(outcome="ok").inc()
            self.round_seconds.observe(event["seconds"])
            self.bytes_sent.inc(event["bytes_sent"])
            self.bytes_received.inc(event["bytes_received"])
            self.peers.set(event["members"])
        elif kind == "round_failed":
            self.rounds.labels(outcome="failed").inc()
        elif kind == "healed":
            self.heals.inc()
            self.healed.inc(len(event["fragments"]))

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread; returns the bound port
        (``port`` 0 picks a free one).

        Raises:
            OSError: the port is taken or the address is not this machine's.
        """
        self.server, _ = start_http_server(port, host, registry=self.registry)
        return int(self.server.server_port)

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
