"""The `ddtctl` command line (Typer): one module per command group, registered here.

Exit codes (ddtctl.errors): 0 ok; 1 a host failed; 2 usage or inventory error; 3 a host was
unreachable; 4 readiness timeout; 5 smoke test failed; 130 interrupted. Human output goes to
stderr; `--json` prints one JSON document on stdout.
"""

from __future__ import annotations

import logging
from typing import Optional

import typer

from ddtctl import __version__
from ddtctl.cli import deploy, inventory, ready, service, status

app = typer.Typer(
    name="ddtctl", add_completion=False, no_args_is_help=True, rich_markup_mode=None,
    help="Deploy, check and smoke-test speculative-decoding LLM servers (DDTree/DFlash, SGLang, vLLM) "
         "on Proxmox LXC containers or on this machine.\n\n"
         "Start with `ddtctl deploy local` (the embedded SmolLM2 model on this machine).\n\n"
         "Exit codes: 0 ok, 1 a host failed, 2 usage/inventory error, 3 unreachable, "
         "4 readiness timeout, 5 smoke failed, 130 interrupted.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ddtctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    inventory_file: Optional[str] = typer.Option(
        None, "--inventory", "-i", envvar="DDTCTL_INVENTORY", metavar="FILE",
        help="Inventory file [default: ./inventory.yaml]."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    ctx.obj = {"inventory": inventory_file}
    # paramiko logs connection failures with tracebacks through logging's last-resort handler;
    # ddtctl reports them itself (UnreachableError, one line): keep library logs off the terminal
    if not logging.getLogger("paramiko").handlers:
        logging.getLogger("paramiko").addHandler(logging.NullHandler())


for _module in (deploy, status, ready, service, inventory):
    _module.register(app)


def main() -> None:
    """Console-script entry point (`ddtctl`)."""
    app()
