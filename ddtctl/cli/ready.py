"""`ddtctl wait-ready | smoke`: readiness polling and the OpenAI API smoke checks."""

from __future__ import annotations

from typing import Optional

import typer

from ddtctl.cli import _common as common
from ddtctl.cli._common import AllOpt, HostsArg, JsonOpt, LimitOpt, ParallelOpt, handle_errors


def register(app: typer.Typer) -> None:
    app.command("wait-ready")(wait_ready_cmd)
    app.command("smoke")(smoke_cmd)


@handle_errors
def wait_ready_cmd(ctx: typer.Context, host: str = typer.Argument(..., metavar="HOST"),
                   timeout: Optional[float] = typer.Option(None, "--timeout", min=1, metavar="S",
                                                           callback=common.finite_seconds,
                                                           help="Deadline in seconds [default: the "
                                                                "service's ready_timeout_s]."),
                   json_out: bool = JsonOpt) -> None:
    """Wait until HOST's service is active, healthy, lists its model and completes a token
    (twice in a row). Exit 4 on timeout, 1 when the service failed (with its last log lines), 3 at
    once when the API refuses the API key (HTTP 401/403).

    Example: ddtctl wait-ready ct200 --timeout 1800
    """
    from ddtctl import report
    from ddtctl.ops.readiness import wait_ready
    from ddtctl.ops.supervisor import manager_for

    target = common.select_one(ctx, host)
    transport = common.transport_for(target)
    said: list[str] = []

    def on_round(probe) -> None:
        """One line per change of what is not ready yet (a poll repeating it prints nothing)."""
        line = f"{target.name}: {probe.step}: {probe.detail}"
        if not probe.ok and (not said or said[-1] != line):
            said.append(line)
            report.info(line)

    try:
        rep = wait_ready(target, transport, manager_for(target, transport), timeout_s=timeout, on_round=on_round)
    finally:
        transport.close()
    report.info(f"{target.name}: ready in {rep.seconds:.1f} s ({rep.rounds} rounds), serving {', '.join(rep.models)}")
    if json_out:
        report.emit_json(rep.to_dict())


@handle_errors
def smoke_cmd(ctx: typer.Context, hosts: Optional[list[str]] = HostsArg, all_hosts: bool = AllOpt,
              limit: Optional[str] = LimitOpt, parallel: int = ParallelOpt, json_out: bool = JsonOpt) -> None:
    """Smoke-test the OpenAI API of each host: factual chat, multi-turn, raw completion, stream ==
    non-stream, stop sequence, 4xx on a bad request, acceptance length. Exit 5 when a check fails,
    3 when the API refuses the API key (HTTP 401/403: set the variable named by api_key_env).

    Example: ddtctl smoke local --json
    """
    from ddtctl import report
    from ddtctl.ops.smoke import require_ok, run_smoke
    from ddtctl.ops.supervisor import manager_for

    selected = common.select(ctx, hosts, all_hosts, limit)
    outcome = common.per_host(selected, lambda h, t: run_smoke(h, t, manager=manager_for(h, t)), parallel)
    reports = [r for _, r, _ in outcome if r is not None]
    report.smoke_table(reports)
    errors = [e for _, _, e in outcome if e is not None]
    for host, _, exc in outcome:
        if exc is not None:
            report.error(report.host_message(host.name, exc))
    for rep in reports:
        try:
            require_ok(rep)
        except Exception as exc:  # noqa: BLE001 - SmokeFailed, collected for the exit code
            errors.append(exc)
    if json_out:
        report.emit_json({"ok": not errors, "hosts": [r.to_dict() for r in reports],
                          "errors": {h.name: str(e) for h, _, e in outcome if e is not None}})
    common.finish(errors)
