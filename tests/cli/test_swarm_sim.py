"""``diloco-node simulate-swarm``: a small table, bad options exit 2."""

from __future__ import annotations

from click.testing import CliRunner

from diloco.cli import main


def test_simulate_swarm_prints_one_row_per_configuration() -> None:
    args = ["simulate-swarm", "--peers", "8,16", "--group-sizes", "4,flat", "--rule", "fail"]
    result = CliRunner().invoke(main, [*args, "--values", "4096", "--rounds", "2"])
    assert result.exit_code == 0, result.output
    rows = [
        line
        for line in result.output.splitlines()
        if line.startswith("| 8 ") or line.startswith("| 16 ")
    ]
    assert len(rows) == 4
    # 16 peers in 4s: a 4x4 grid, 3 + 3 streams per peer; flat: 15.
    assert "| 16 | 4 | 4x4 | 6.0 |" in result.output
    assert "| 16 | flat | 16 | 15.0 |" in result.output


def test_simulate_swarm_bad_group_size_exits_2() -> None:
    result = CliRunner().invoke(main, ["simulate-swarm", "--peers", "8", "--group-sizes", "1"])
    assert result.exit_code == 2
    assert "max_group_size" in result.output


def test_simulate_swarm_bad_list_exits_2() -> None:
    result = CliRunner().invoke(main, ["simulate-swarm", "--group-sizes", "eight"])
    assert result.exit_code == 2
