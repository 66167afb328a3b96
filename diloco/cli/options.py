"""Click options made from the flag tables of ``diloco.node.flags``.

Each option's type, choices and default come from its dataclass field, so a default is
written once, in the dataclass: ``bool`` fields become flags (with a ``--no-`` form when
on by default), ``Literal`` fields choices, ``tuple[str, ...]`` fields repeatable options,
``X | None`` fields options of type ``X`` whose absence means None.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import click
from click.core import ParameterSource

from diloco.node.flags import RUN_FLAGS, Flag, Flags

F = TypeVar("F", bound=Callable[..., Any])

_PATHS = {
    "file": click.Path(dir_okay=False),
    "dir": click.Path(file_okay=False),
    "existing": click.Path(exists=True),
}


def flag_options(*tables: Flags[Any]) -> Callable[[F], F]:
    """Decorate a command with the options of ``tables``, in the tables' order."""

    def decorate(f: F) -> F:
        for table in reversed(tables):
            for flag in reversed(table.flags):
                kwargs = option_settings(table, flag)
                name = flag.name
                if kwargs.get("is_flag") and kwargs["default"] is True:  # on by default
                    name = f"{name}/--no-{name[2:]}"
                f = click.option(name, flag.dest, help=flag.help, hidden=flag.hidden, **kwargs)(f)
        return f

    return decorate


def option_settings(table: Flags[Any], flag: Flag) -> dict[str, Any]:
    """``click.option`` keywords for ``flag``: type (or flag, choices, repeat) and default."""
    hint, default = table.hint(flag), table.default(flag)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return {"is_flag": True, "default": default}
    if origin is Literal:
        return {"type": click.Choice([str(a) for a in args]), "default": default}
    if origin is tuple:
        return {"multiple": True, "type": args[0], "default": default}
    return {"type": _PATHS[flag.kind] if flag.kind else hint, "default": default}


def typed_flags(ctx: click.Context, table: Flags[Any]) -> dict[str, object]:
    """The values of ``table``'s flags that were typed on the command line, by name."""
    return {
        flag.dest: ctx.params[flag.dest]
        for flag in table.flags
        if ctx.get_parameter_source(flag.dest) is ParameterSource.COMMANDLINE
    }


SWARM_HEADING = "Run settings (these come from the swarm; set one only to check it matches)"


class JoinCommand(click.Command):
    """``join``'s help: what a joiner chooses first, then the run's settings apart, under a
    heading saying they come from the swarm, without ``start``'s defaults (the swarm's run
    holds the values that apply)."""

    swarm_dests = frozenset(["config_file", *(flag.dest for flag in RUN_FLAGS.flags)])

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, click.Option) and param.name in self.swarm_dests:
                param.show_default = False

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        own: list[tuple[str, str]] = []
        swarm: list[tuple[str, str]] = []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                (swarm if param.name in self.swarm_dests else own).append(record)
        with formatter.section("Options"):
            formatter.write_dl(own)
        with formatter.section(SWARM_HEADING):
            formatter.write_dl(swarm)
