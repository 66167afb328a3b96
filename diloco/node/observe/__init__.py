"""Watching a node (docs/design.md "Watching a run").

- ``recent_metrics``: the node's recent figures for its DHT metrics record (dashboards).
- ``metrics_exporter``: Prometheus; ``trackers``: Weights & Biases and TensorBoard.
- ``traffic``: bytes of a round against what data-parallel would send.
"""
