"""Where ddtctl finds its inventory and keeps its state (paths only, no parsing).

Without `--inventory` / `$DDTCTL_INVENTORY` the inventory is the first `inventory.yaml` found
in the working directory or one of its parents (as git finds its repository), else
`$XDG_CONFIG_HOME/ddtctl/inventory.yaml` (XDG Base Directory Specification: default
`~/.config`), else the one of the checkout ddtctl runs from (its `local` host).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_INVENTORY = "inventory.yaml"


def inventory_candidates(cwd: Path | None = None) -> list[Path]:
    """Where ddtctl looks for an inventory without --inventory / $DDTCTL_INVENTORY, in order:
    `inventory.yaml` in the working directory and each parent up to `/` (like git finds its
    repository), `$XDG_CONFIG_HOME/ddtctl/inventory.yaml` (default `~/.config/ddtctl/...`), and
    the `inventory.yaml` of the checkout ddtctl runs from (its `local` host, e.g. after `make demo`)."""
    here = (cwd or Path.cwd()).resolve()
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config").expanduser()
    checkout = Path(__file__).resolve().parents[1] / DEFAULT_INVENTORY
    return [d / DEFAULT_INVENTORY for d in (here, *here.parents)] + [config / "ddtctl" / DEFAULT_INVENTORY, checkout]


def inventory_path(explicit: str | os.PathLike | None = None) -> Path:
    """The inventory file: `--inventory`, else $DDTCTL_INVENTORY, else the first of
    `inventory_candidates()` that exists (else ./inventory.yaml, which then cannot be read)."""
    chosen = explicit or os.environ.get("DDTCTL_INVENTORY")
    if chosen:
        return Path(chosen)
    return next((p for p in inventory_candidates() if p.is_file()), Path(DEFAULT_INVENTORY))


def ddtctl_home() -> Path:
    """ddtctl's state directory: $DDTCTL_HOME, else ~/.local/state/ddtctl (not created here)."""
    env = os.environ.get("DDTCTL_HOME")
    return Path(env).expanduser() if env else Path.home() / ".local" / "state" / "ddtctl"
