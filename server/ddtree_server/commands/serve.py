"""`ddtree-server serve` (placeholder until implemented)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this sub-command to the Typer app (nothing yet)."""
