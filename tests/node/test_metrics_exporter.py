"""Prometheus metrics from node events, scraped over HTTP as a Prometheus server would."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from diloco.node.observe.metrics_exporter import NodeMetrics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _feed(metrics: NodeMetrics) -> None:
    metrics.observe(
        {
            "event": "config",
            "run_id": "r-0123456789abcdef",
            "peer_id": "P",
            "codec": "e3m0",
            "tokens_per_step": 64,
        }
    )
    for step in (1, 2):
        metrics.observe({"event": "step", "step": step, "loss": 5.0})
    metrics.observe(
        {
            "event": "progress",
            "step": 2,
            "loss": 4.5,
            "tokens_per_s": 900.0,
            "cu": 0.5,
            "mb_sent": 0.0,
            "mb_received": 0.0,
            "peers_last_round": 0,
        }
    )
    metrics.observe(
        {
            "event": "round",
            "step": 2,
            "fragment": 0,
            "round": 1,
            "members": 3,
            "bytes_sent": 1000,
            "bytes_received": 1200,
            "seconds": 0.7,
        }
    )
    metrics.observe({"event": "round_failed", "step": 2, "fragment": 1, "round": 1})
    metrics.observe({"event": "healed", "step": 2, "fragments": [1]})
    metrics.observe({"event": "eval", "step": 2, "loss_outer": 4.25})


def test_scrape_shows_every_metric_from_events() -> None:
    metrics = NodeMetrics()
    port = metrics.serve(0)
    try:
        before = _samples(
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        )
        _feed(metrics)
        after = _samples(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
    finally:
        metrics.close()
    assert before[("diloco_rounds_total", (("outcome", "ok"),))] == 0
    assert before[("diloco_rounds_total", (("outcome", "failed"),))] == 0
    assert after[("diloco_rounds_total", (("outcome", "ok"),))] == 1
    assert after[("diloco_rounds_total", (("outcome", "failed"),))] == 1
    assert after[("diloco_steps_total", ())] == 2
    assert after[("diloco_tokens_total", ())] == 128
    assert after[("diloco_bytes_sent_total", ())] == 1000
    assert after[("diloco_bytes_received_total", ())] == 1200
    assert after[("diloco_round_seconds_count", ())] == 1
    assert after[("diloco_round_seconds_bucket", (("le", "1.0"),))] == 1
    assert after[("diloco_round_seconds_bucket", (("le", "0.5"),))] == 0
    assert after[("diloco_heal_events_total", ())] == 1
    assert after[("diloco_healed_fragments_total", ())] == 1
    assert after[("diloco_peers_last_round", ())] == 3
    assert after[("diloco_compute_utilisation_ratio", ())] == 0.5
    assert not [name for name, _ in after if name.endswith("_per_second")]
    assert after[("process_resident_memory_bytes", ())] > 0
    assert after[("process_cpu_seconds_total", ())] > 0
    assert after[("diloco_loss", ())] == 4.5
    assert after[("diloco_eval_loss_outer", ())] == 4.25
    assert after[("diloco_global_step", ())] == 2
    info = (("codec", "e3m0"), ("peer_id", "P"), ("run_id", "r-0123456789abcdef"))
    assert after[("diloco_node_info", info)] == 1


def test_two_nodes_in_one_process_keep_their_own_registries() -> None:
    a, b = NodeMetrics(), NodeMetrics()
    a.observe({"event": "step", "step": 1})
    assert a.steps._value.get() == 1 and b.steps._value.get() == 0


def test_port_in_use_is_an_os_error() -> None:
    first = NodeMetrics()
    port = first.serve(0)
    try:
        with pytest.raises(OSError):
            NodeMetrics().serve(port)
    finally:
        first.close()
