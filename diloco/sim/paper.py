"""The paper's own simulation results, to compare ours against (docs/design.md "The simulator").

Douillard et al., 2025, "Streaming DiLoCo with overlapping communication", arXiv:2501.18512v1,
appendix Table 4: Gbit/s each method needs to reach a CU of 50/80/90/95/99%, with H = 100 and
fragments of 3 layers, for 1B / 10B / 100B models of 24 / 48 / 108 layers taking 0.1 / 0.8 /
4.9 s per step (our ``PRESETS``). Its values sit on a log grid of ratio ``PAPER_GRID_STEP``
(e.g. 390.7, 471.5 and 569.0 are consecutive points), printed with one decimal.
"""

from __future__ import annotations

from diloco.sim.methods import Method

PAPER_TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
"""The CU targets of the table's columns."""

PAPER_TABLE4: dict[str, dict[Method, tuple[float, ...]]] = {
    "1B": {
        "dp": (86.8, 152.6, 184.2, 222.3, 569.0),
        "diloco": (1.4, 6.2, 13.3, 23.3, 86.8),
        "streaming": (1.4, 5.2, 9.1, 16.0, 28.1),
        "streaming-overlap": (1.4, 4.3, 6.2, 9.1, 11.0),
        "streaming-overlap-fp4": (0.4, 0.9, 1.7, 2.0, 3.0),
    },
    "10B": {
        "dp": (104.8, 222.3, 222.3, 268.3, 471.5),
        "diloco": (1.7, 7.5, 16.0, 33.9, 104.8),
        "streaming": (1.7, 5.2, 9.1, 13.3, 19.3),
        "streaming-overlap": (1.7, 3.6, 5.2, 6.2, 7.5),
        "streaming-overlap-fp4": (0.4, 0.9, 1.4, 1.4, 1.7),
    },
    "100B": {
        "dp": (184.2, 323.8, 390.7, 390.7, 471.5),
        "diloco": (3.0, 11.0, 23.3, 49.4, 184.2),
        "streaming": (2.4, 6.2, 9.1, 11.0, 19.3),
        "streaming-overlap": (1.7, 3.6, 4.3, 5.2, 5.2),
        "streaming-overlap-fp4": (0.5, 0.9, 1.1, 1.1, 1.4),
    },
}
"""Gbit/s by preset, method and target (the paper's rows, in our method names)."""

PAPER_GRID_STEP = 1.2068
"""Ratio of consecutive points of the paper's bandwidth grid (471.5 / 390.7)."""
