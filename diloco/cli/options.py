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

from diloco.node.flags import Flag, Flags

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
