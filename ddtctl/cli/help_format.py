"""Plain `--help` without Typer's type placeholders (`HOST <str>`, `--timeout <float range>`).

Typer's plain (non-Rich) help writes the Python type of every argument and option in angle
brackets, and an argument's `metavar` does not replace it. `PlainHelpCommand` formats the
"Arguments" and "Options" sections as Typer does, but shows an argument by its name alone and an
option's value the way click does: the option's own `metavar` when it has one, else the type in
capitals (`INTEGER`, `FLOAT`, `TEXT`, `PATH`; choices as `[a|b]`); ranges and defaults stay in
the help text. ddtree-server keeps its own copy (server/ddtree_server/commands/help_format.py):
the two distributions never import each other.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import typer
from typer.core import TyperCommand

if TYPE_CHECKING:       # annotations only: typer's commands run on typer's own click
    import click

_PLACEHOLDER = re.compile(r" <([^<>]+)>")
_NAMES = {"int": "INTEGER", "float": "FLOAT", "str": "TEXT", "path": "PATH", "file": "FILE",
          "directory": "DIRECTORY", "bool": "BOOLEAN", "datetime": "DATETIME"}


def click_metavar(label: str) -> str:
    """`float range` -> FLOAT, `list[str]` -> TEXT, `a|b` -> [a|b], `Path` -> PATH."""
    label = label.removesuffix(" range")
    inner = re.fullmatch(r"list\[(.+)\]", label)
    label = inner.group(1) if inner else label
    if "|" in label:
        return f"[{label}]"
    return _NAMES.get(label.lower(), label.upper())


class PlainHelpCommand(TyperCommand):
    """A Typer command whose help shows no `<type>` placeholders (see the module docstring)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        args, opts = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            name, text = record
            if param.param_type_name == "argument":
                args.append((_PLACEHOLDER.sub("", name), text))
            else:
                opts.append((_PLACEHOLDER.sub(lambda m: " " + click_metavar(m.group(1)), name), text))
        if args:
            with formatter.section("Arguments"):
                formatter.write_dl(args)
        if opts:
            with formatter.section("Options"):
                formatter.write_dl(opts)


def use_plain_help(app: typer.Typer) -> None:
    """Make every command registered on `app` so far a `PlainHelpCommand` (unless it already has
    another class of its own)."""
    for info in app.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = PlainHelpCommand
