"""`ddtctl status`: unit state, readiness, models, GPUs, acceptance length, deployed version."""

from __future__ import annotations

from typing import Optional

import typer

from ddtctl.cli import _common as common
from ddtctl.cli._common import AllOpt, HostsArg, JsonOpt, LimitOpt, StatusParallelOpt, handle_errors
from ddtctl.errors import ExitCode


def register(app: typer.Typer) -> None:
    app.command("status")(status_cmd)


@handle_errors
def status_cmd(ctx: typer.Context, hosts: Optional[list[str]] = HostsArg, all_hosts: bool = AllOpt,
               limit: Optional[str] = LimitOpt, parallel: int = StatusParallelOpt,
               gpu: bool = typer.Option(True, "--gpu/--no-gpu", help="Query nvidia-smi."),
               json_out: bool = JsonOpt) -> None:
    """Show each host's service state, readiness, served models, GPUs, mean acceptance length and
    tokens/s (from /metrics) and the deployed server release (flagged when it differs from this
    checkout). The `ready` column says ok, or why not: `stopped` (the service, on purpose),
    `loading`/`warming`, `failed`, `container stopped`, `container missing`/`no pct` (not where
    the inventory says), `unreachable` (with the cause) or `auth failed` (HTTP 401/403: set the
    API-key variable). nvidia-smi's [N/A] / [Insufficient Permissions] are shown with their
    meaning. Exit 1 when a host is not ok, 3 when a host is unreachable or refuses the API key.

    Example: ddtctl status --all
    """
    from ddtctl import report
    from ddtctl.ops.bundle import source_identity
    from ddtctl.ops.status import gather

    selected = common.select(ctx, hosts, all_hosts, limit)
    expected = source_identity().version_id if any(h.service.kind == "ddtree" for h in selected) else None
    statuses = gather(selected, lambda h: common.transport_for(h), parallel=parallel,
                      expected_release=expected, gpus=gpu)
    report.status_table(statuses)
    if json_out:
        report.emit_json({"ok": all(s.ok for s in statuses), "checkout_release": expected,
                          "hosts": [s.to_dict() for s in statuses]})
    if any(s.unreachable or s.auth_failed for s in statuses):
        raise typer.Exit(int(ExitCode.UNREACHABLE))
    if not all(s.ok for s in statuses):
        raise typer.Exit(int(ExitCode.HOST_FAILED))
