"""`ddtctl deploy | rollback | releases`: install and switch server releases."""

from __future__ import annotations

from typing import Optional

import typer

from ddtctl.cli import _common as common
from ddtctl.cli._common import AllOpt, HostsArg, JsonOpt, LimitOpt, ParallelOpt, handle_errors
from ddtctl.errors import DdtctlError

BreakLockOpt = typer.Option(False, "--break-lock", help="First remove a host lock left behind by a killed "
                            "ddtctl run; only when no other deploy or rollback is running.")


def register(app: typer.Typer) -> None:
    app.command("deploy")(deploy_cmd)
    app.command("rollback")(rollback_cmd)
    app.command("releases")(releases_cmd)


@handle_errors
def deploy_cmd(
    ctx: typer.Context,
    hosts: Optional[list[str]] = HostsArg,
    all_hosts: bool = AllOpt,
    limit: Optional[str] = LimitOpt,
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Print the plan and unit diffs; change nothing. "
                                 "Still connects to the hosts to read what is there (release links, release "
                                 "verification, unit files, weight manifests, `pct config`), like Ansible's "
                                 "check mode."),
    smoke: bool = typer.Option(True, "--smoke/--no-smoke", help="Run the smoke checks after wait-ready."),
    verify: bool = typer.Option(False, "--verify", help="Re-hash every pushed weight file on the target "
                                "(sha256) and send again what differs; without it only files whose size, "
                                "mtime or inode changed since the last push are re-hashed."),
    timeout: Optional[float] = typer.Option(None, "--timeout", min=1, metavar="SECONDS",
                                            callback=common.finite_seconds,
                                            help="wait-ready deadline [default: the service's ready_timeout_s]."),
    rollback_timeout: Optional[float] = typer.Option(None, "--rollback-timeout", min=1, metavar="SECONDS",
                                                     callback=common.finite_seconds,
                                                     help="The rollback's own wait-ready deadline in seconds, "
                                                          "independent of --timeout [default: the service's "
                                                          "ready_timeout_s]."),
    parallel: int = ParallelOpt,
    json_out: bool = JsonOpt,
    break_lock: bool = BreakLockOpt,
) -> None:
    """Build the server wheel of this checkout, verify or install its release (with its
    dependencies: packages.mode index, wheelhouse or system), (re)start only if something
    changed, wait until ready and smoke-test; roll back to the previous release if that fails
    (the rollback waits for readiness under --rollback-timeout, not --timeout). A unit that hit its
    systemd start limit is reset (`systemctl reset-failed`) before every restart.

    Example: ddtctl deploy local
    """
    from ddtctl import report
    from ddtctl.ops.bundle import build_wheel, source_identity
    from ddtctl.ops.deploy import DeployResult, deploy_host

    selected = common.select(ctx, hosts, all_hosts, limit)
    if dry_run and break_lock:
        report.info("--break-lock is ignored with --dry-run (a dry run takes no lock and changes nothing)")
    bundle = None
    if any(h.service.kind == "ddtree" for h in selected):
        bundle = source_identity() if dry_run else build_wheel()
        if not dry_run and bundle.built:
            report.info(f"built {bundle.wheel.name} ({bundle.version_id})")
    with report.progress_bars(enabled=not dry_run) as bars:
        def one(host, transport) -> DeployResult:
            return deploy_host(host, transport, bundle=bundle, node_transport=common.node_of(transport),
                               dry_run=dry_run, smoke=smoke, timeout_s=timeout, progress_factory=bars,
                               log=report.step_line, break_lock=break_lock, rollback_timeout_s=rollback_timeout,
                               verify=verify)
        outcome = common.per_host(selected, one, parallel)
    results = [r if r is not None else DeployResult(h.name, dry_run=dry_run, error=e) for h, r, e in outcome]
    if dry_run:
        report.diffs(results)
    report.deploy_table(results)
    if json_out:
        report.emit_json({"ok": all(r.ok for r in results), "hosts": [r.to_dict() for r in results]})
    common.finish([r.error for r in results if r.error is not None])


@handle_errors
def rollback_cmd(ctx: typer.Context, host: str = typer.Argument(..., metavar="HOST"),
                 timeout: Optional[float] = typer.Option(None, "--timeout", min=1, metavar="SECONDS",
                                                         callback=common.finite_seconds,
                                                         help="wait-ready deadline of the previous release "
                                                              "[default: the service's ready_timeout_s]."),
                 json_out: bool = JsonOpt, break_lock: bool = BreakLockOpt) -> None:
    """Switch HOST back to its previous release, restart it (after `systemctl reset-failed`) and
    wait until ready. When the previous release does not come back, the links are restored, the
    release that was running is restarted, and the message says which state the service is in.

    Example: ddtctl rollback ct200
    """
    from ddtctl import report
    from ddtctl.ops import recovery

    target = common.select_one(ctx, host)
    transport = common.transport_for(target)
    try:
        result = recovery.rollback(target, transport, timeout_s=timeout, break_lock=break_lock)
    except DdtctlError as exc:   # RecoveryFailed, no previous release, unreachable, locked, ...
        if json_out:
            partial = getattr(exc, "rollback_result", None)
            done = partial.to_dict() if partial else {"host": target.name}
            report.emit_json({"ok": False, **done, "error": str(exc)})
        raise
    finally:
        transport.close()
    report.info(f"{target.name}: rolled back {result.from_release} -> {result.to_release}; ready in "
                f"{result.ready.seconds:.1f} s; service: {result.service}; serving {target.model_id} at {target.url}")
    if json_out:
        report.emit_json({"ok": True, **result.to_dict()})


@handle_errors
def releases_cmd(ctx: typer.Context, host: str = typer.Argument(..., metavar="HOST"),
                 prune: Optional[int] = typer.Option(None, "--prune", min=1, metavar="N",
                                                     help="Delete all but the N newest (current and "
                                                          "previous are always kept)."),
                 json_out: bool = JsonOpt) -> None:
    """List the server releases installed on HOST (and optionally prune old ones).

    Example: ddtctl releases local --prune 3
    """
    from ddtctl import report
    from ddtctl.ops import releases

    target = common.select_one(ctx, host)
    transport = common.transport_for(target)
    try:
        layout = releases.Layout(target.root, target.unit)
        deleted = releases.prune(transport, layout, prune) if prune else []
        rels = releases.list_releases(transport, layout)
    finally:
        transport.close()
    report.releases_table(target.name, rels)
    if deleted:
        report.info(f"{target.name}: deleted {', '.join(deleted)}")
    if json_out:
        report.emit_json({"host": target.name, "releases": [r.to_dict() for r in rels], "deleted": deleted})
