"""The `ddtree-server` command line: serve | generate | train-drafter | bench | probe.

Each sub-command lives in its own module under `ddtree_server.commands` and registers itself on
the Typer app; heavy imports (torch, transformers) happen inside the command functions so that
`ddtree-server --help` stays fast.
"""

from __future__ import annotations

import typer

from ddtree_server import __version__
from ddtree_server.commands import bench, generate, probe, serve, train
from ddtree_server.commands.help_format import use_plain_help

# rich_markup_mode=None: click's plain help, as ddtctl's. Typer's Rich help shows a type column for
# every option, flags included (`--json <bool>`, even `--help <bool>`); plain help shows flags as
# flags (`--json`, `--chat / --raw`).
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help=__doc__.splitlines()[0])


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ddtree-server {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """OpenAI-compatible server with exact DDTree / DFlash speculative decoding."""


for _module in (serve, generate, train, bench, probe):
    _module.register(app)
use_plain_help(app)      # no Typer `<type>` placeholders in --help


def main() -> None:
    """Console-script entry point."""
    app()
