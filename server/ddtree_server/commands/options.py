"""Option parsers shared by the sub-commands."""

from __future__ import annotations

import typer


def int_list(text: str) -> list[int]:
    """``"1, 10,19"`` -> ``[1, 10, 19]``; raises typer.BadParameter (exit 2) on anything else."""
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def run_single(command) -> None:
    """Run one command function as a program (the ``python -m`` entry points) with click's plain
    help, like the ``ddtree-server`` CLI (Typer's Rich help shows ``<bool>`` for flags)."""
    app = typer.Typer(add_completion=False, rich_markup_mode=None)
    app.command()(command)
    app()
