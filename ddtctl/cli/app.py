"""The `ddtctl` command line (Typer): one module per command group, registered here.

Exit codes (ddtctl.errors): 0 ok; 1 a host failed; 2 usage or inventory error; 3 a host was
unreachable; 4 readiness timeout; 5 smoke test failed; 130 interrupted. Human output goes to
stderr; `--json` prints one JSON document on stdout.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ddtctl import __version__
from ddtctl.cli import deploy, inventory, ready, service, status
from ddtctl.cli.help_format import use_plain_help

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
        help="Inventory file, before or after the command [default: ./inventory.yaml]."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    import logging

    ctx.obj = {"inventory": inventory_file}
    # paramiko logs connection failures with tracebacks through logging's last-resort handler;
    # ddtctl reports them itself (UnreachableError, one line): keep library logs off the terminal
    if not logging.getLogger("paramiko").handlers:
        logging.getLogger("paramiko").addHandler(logging.NullHandler())


_GLOBAL = ("--inventory", "-i")


def hoist_inventory(args: list[str], stop_at_first_word: frozenset[str] = frozenset({"exec"})) -> list[str]:
    """`--inventory FILE` / `-i FILE` / `--inventory=FILE` given after the command name, moved
    before it (`ddtctl status --all -i f.yaml` == `ddtctl -i f.yaml status --all`); the last one
    wins, as for any repeated option. Nothing after `--` moves, nor anything after the first
    argument of a command that stops parsing options there (`exec HOST ARGV...`)."""
    head, i = [], 0
    while i < len(args) and args[i].startswith("-"):            # options before the command
        takes_value = args[i] in _GLOBAL
        head += args[i:i + 1 + takes_value]
        i += 1 + takes_value
    if i >= len(args):
        return list(args)
    command, rest, moved, j = args[i], [], [], i + 1
    while j < len(args):
        word = args[j]
        if word == "--":
            rest += args[j:]
            break
        if word in _GLOBAL and j + 1 < len(args):
            moved += [word, args[j + 1]]
            j += 2
            continue
        if word.startswith("--inventory="):
            moved.append(word)
        else:
            rest.append(word)
            if command in stop_at_first_word and not word.startswith("-"):
                rest += args[j + 1:]
                break
        j += 1
    return [*head, *moved, command, *rest]


for _module in (deploy, status, ready, service, inventory):
    _module.register(app)
use_plain_help(app)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (`ddtctl`); `--inventory` may also follow the command."""
    app(args=hoist_inventory(sys.argv[1:] if argv is None else argv), prog_name="ddtctl")
