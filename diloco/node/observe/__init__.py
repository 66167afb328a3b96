"""Watching a node (docs/design.md "Watching a run").

- ``recent_metrics``: the node's recent figures for its DHT metrics record (dashboards).
- ``round_events``: the record of each round a node applied or failed (its metrics file).
- ``metrics_exporter``: Prometheus; ``trackers``: Weights & Biases and TensorBoard.
- ``traffic``: bytes of a round against what data-parallel would send.
"""
