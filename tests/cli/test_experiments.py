"""The experiment commands' options: defaults from their dataclasses, bad values exit 2."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from diloco.cli import main
from diloco.cli.experiments import ACCOUNTING_SYNC_FLAGS, BENCH_FLAGS, LOCAL_FLAGS, SYNC_FLAGS
from diloco.node.flags import Flags


def options(*path: str) -> dict[str, click.Option]:
    command: click.Command = main
    for name in path:
        assert isinstance(command, click.Group)
        command = command.commands[name]
    return {p.name: p for p in command.params if isinstance(p, click.Option) and p.name}


@pytest.mark.parametrize(
    ("path", "table"),
    [
        (("local",), LOCAL_FLAGS),
        (("simulate",), SYNC_FLAGS),
        (("accounting",), ACCOUNTING_SYNC_FLAGS),
        (("bench", "allreduce"), BENCH_FLAGS),
    ],
)
def test_option_defaults_are_the_dataclass_defaults(
    path: tuple[str, ...], table: Flags[object]
) -> None:
    params = options(*path)
    for flag in table.flags:
        assert params[flag.dest].default == table.default(flag), flag.name


def test_local_defaults_are_the_runs() -> None:
    local = {name: p.default for name, p in options("local").items()}
    assert (local["outer_lr"], local["inner_lr"], local["warmup"]) == (0.7, 1e-3, 30)
    assert (local["steps"], local["h"], local["batch_size"], local["seq_len"]) == (600, 30, 8, 64)
    assert local["tau"] == "1" and local["method"] == "streaming" and local["codec"] is None
    sim = {name: p.default for name, p in options("simulate").items()}
    assert (sim["h"], sim["fragment_size"], sim["tau"], sim["replicas"]) == (100, 3, 1, 2)
    bench = {name: p.default for name, p in options("bench", "allreduce").items()}
    assert (bench["peers"], bench["rounds"], bench["numel"], bench["window"]) == (
        4,
        3,
        10_000_000,
        2.0,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["local", "--steps", "0"], "steps >= 1"),
        (["local", "--tau", "1,x"], "expected an integer or a list"),
        (["local", "--data", "/missing/corpus"], "'/missing/corpus' does not exist"),
        (["accounting", "--replicas", "1"], "at least 2 replicas"),
        (["bench", "allreduce", "--peers", "1"], "--peers >= 2"),
    ],
)
def test_bad_values_exit_2(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
