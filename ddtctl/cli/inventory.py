"""`ddtctl inventory`: validate the inventory file and show its hosts and groups."""

from __future__ import annotations

import typer

from ddtctl.cli._common import JsonOpt, handle_errors
from ddtctl.cli._common import inventory as load


def register(app: typer.Typer) -> None:
    app.command("inventory")(inventory_show)


@handle_errors
def inventory_show(ctx: typer.Context, json_out: bool = JsonOpt) -> None:
    """Validate the inventory and list hosts, services and groups.

    Errors are printed as FILE:LINE: key.path: message (exit 2).

    Example: ddtctl --inventory examples/proxmox-fleet.yaml inventory
    """
    from ddtctl import report

    inv = load(ctx)
    if json_out:
        report.emit_json({
            "path": str(inv.path), "groups": inv.groups,
            "hosts": {n: {"kind": h.kind, "address": h.address, "node": h.node_name, "vmid": h.vmid,
                          "root": h.root, "unit": h.unit, "model_id": h.model_id, "url": h.url,
                          "service": h.service.model_dump(mode="json"),
                          "packages": h.packages.to_dict() if h.packages else None,
                          **({"backends": [{"name": b.name, "url": b.base_url} for b in h.backends]}
                             if h.service.kind == "router" else {})}
                      for n, h in inv.hosts.items()}})
    else:
        report.inventory_table(inv)
        report.info(f"{inv.path}: ok ({len(inv.hosts)} hosts, {len(inv.model.nodes)} nodes)")
