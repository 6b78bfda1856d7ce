"""`ddtctl start | stop | restart | logs | exec | render`: operate one service directly."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ddtctl.cli import _common as common
from ddtctl.cli._common import AllOpt, HostsArg, LimitOpt, ParallelOpt, handle_errors
from ddtctl.errors import UsageError


def register(app: typer.Typer) -> None:
    for verb in ("start", "stop", "restart"):
        app.command(verb, help=f"{verb.capitalize()} the service on each HOST (no readiness wait; "
                               f"see wait-ready).\n\nExample: ddtctl {verb} ct200")(_lifecycle(verb))
    app.command("logs")(logs_cmd)
    app.command("exec", context_settings={"allow_interspersed_args": False})(exec_cmd)
    app.command("render")(render_cmd)


def _lifecycle(verb: str):
    @handle_errors
    def command(ctx: typer.Context, hosts: Optional[list[str]] = HostsArg, all_hosts: bool = AllOpt,
                limit: Optional[str] = LimitOpt, parallel: int = ParallelOpt) -> None:
        from ddtctl import report
        from ddtctl.ops.supervisor import manager_for

        selected = common.select(ctx, hosts, all_hosts, limit)

        def one(host, transport):
            manager = manager_for(host, transport)
            getattr(manager, verb)()
            return manager.state()
        outcome = common.per_host(selected, one, parallel)
        for host, state, exc in outcome:
            if exc is None:
                report.info(f"{host.name}: {verb} {host.unit}: {state.active}")
            else:
                report.error(report.host_message(host.name, exc))
        common.finish([e for _, _, e in outcome if e is not None])
    command.__name__ = f"service_{verb}"
    return command


@handle_errors
def logs_cmd(ctx: typer.Context, host: str = typer.Argument(..., metavar="HOST"),
             lines: int = typer.Option(50, "-n", "--lines", min=1, help="How many lines.")) -> None:
    """Print the last lines of the service log (journalctl, or the local supervisor's log file).

    Example: ddtctl logs ct200 -n 200
    """
    from ddtctl.ops.supervisor import manager_for

    target = common.select_one(ctx, host)
    transport = common.transport_for(target)
    try:
        typer.echo(manager_for(target, transport).logs(lines), nl=False)
    finally:
        transport.close()


@handle_errors
def exec_cmd(ctx: typer.Context, host: str = typer.Argument(..., metavar="HOST"),
             argv: Optional[list[str]] = typer.Argument(None, metavar="-- ARGV...",
                                                        help="Command and arguments."),
             timeout: Optional[float] = typer.Option(
                 None, "--timeout", min=0.001, metavar="S", callback=common.finite_seconds,
                 help="Stop the command after S seconds like timeout(1): SIGTERM, SIGKILL 5 s "
                      "later; exit 124 (137 when it had to be killed).")) -> None:
    """Run one command on HOST (inside the container) like `ssh HOST cmd`: stdin is forwarded
    (EOF included), stdout/stderr are relayed byte for byte as they arrive, and ddtctl exits with
    the command's exit status. The argv is passed as-is: no shell, no quoting to worry about.
    Options go before HOST.

    Example: ddtctl exec ct200 -- nvidia-smi -L;  ddtctl exec --timeout 60 ct200 -- journalctl -f
    """
    from ddtctl.remote import relay

    if argv and argv[0] != "--" and argv[0].startswith("-"):
        before = argv[:argv.index("--")] if "--" in argv else argv[:1]
        raise UsageError(f"exec takes no options after HOST (got {' '.join(before)!r}); put options "
                         "before HOST and the command after --, e.g. ddtctl exec HOST -- uname -a")
    target = common.select_one(ctx, host)
    argv = argv[1:] if argv and argv[0] == "--" else argv
    if not argv:
        raise UsageError("give a command after --, e.g. ddtctl exec HOST -- uname -a")
    transport = common.transport_for(target)
    stdin = sys.stdin.buffer if sys.stdin is not None else None
    try:
        code = transport.stream(argv, stdin=stdin, stdout=sys.stdout.buffer, stderr=sys.stderr.buffer,
                                timeout=timeout)
    except relay.BrokenOutput:
        code = 1                                  # the reader went away (Python's broken-pipe code)
    finally:
        transport.close()
    if code:
        raise typer.Exit(code)


@handle_errors
def render_cmd(ctx: typer.Context, host: str = typer.Argument(..., metavar="HOST")) -> None:
    """Print the files deploy would install for HOST: the systemd unit and its EnvironmentFile
    (local hosts: the supervisor's JSON service spec). Nothing is contacted.

    Example: ddtctl render ct200
    """
    from ddtctl.ops.units import render_env, render_local, render_unit, service_spec, unit_path

    target = common.select_one(ctx, host)
    spec = service_spec(target)
    if target.kind == "local":
        typer.echo(f"# local supervisor service spec ({target.name})\n{render_local(spec)}", nl=False)
        return
    typer.echo(f"# {unit_path(spec.unit)}\n{render_unit(spec)}\n# {spec.env_file}\n{render_env(spec)}", nl=False)
