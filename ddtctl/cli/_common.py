"""Shared CLI plumbing: options, inventory + host selection, the transport factory, error handling.

`transport_for(host)` is the one place transports are made (tests and other front ends can
replace it). During a command (`handle_errors`) every container of one node shares ONE SSH
connection (`node_pool`): their `pct exec` commands are channels over that transport. Every command runs inside `handle_errors`: a DdtctlError becomes a one-line (or
per-host) message on stderr and its documented exit code, never a traceback; Ctrl-C and broken
pipes are handled the same way in every command (see `handle_errors`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import typer

from ddtctl import cancel, output
from ddtctl.errors import DdtctlError, ExitCode, UsageError, exit_code_for
from ddtctl.inventory_files import ddtctl_home
from ddtctl.remote.nodepool import NodePool

if TYPE_CHECKING:   # the inventory (pydantic schema) is imported by the commands that read it
    from ddtctl.inventory import Host, Inventory

HostsArg = typer.Argument(None, metavar="[HOST|GROUP]...", help="Host or group names (globs allowed).",
                          show_default=False)
AllOpt = typer.Option(False, "--all", help="Every host in the inventory.")
LimitOpt = typer.Option(None, "--limit", "-l", metavar="PATTERN",
                        help="Only hosts matching this glob or group (comma-separated).")
ParallelOpt = typer.Option(4, "--parallel", "-p", min=1, max=64, help="Hosts handled at the same time.")
# status only reads: 16 hosts at once (a node's containers share its connection, at most 8 channels)
StatusParallelOpt = typer.Option(16, "--parallel", "-p", min=1, max=64, help="Hosts asked at the same time.")
JsonOpt = typer.Option(False, "--json", help="One JSON document on stdout (human output stays on stderr).")


def finite_seconds(value: Optional[float]) -> Optional[float]:
    """Callback of the --timeout options: every deadline must end (`inf` is exit 2, as the
    inventory refuses a non-finite ready_timeout_s)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter("must be a finite number of seconds (a deadline must end)")
    return value


def inventory(ctx: typer.Context) -> Inventory:
    """The inventory chosen by --inventory / DDTCTL_INVENTORY / ./inventory.yaml."""
    from ddtctl.inventory import load_inventory     # pydantic: only for commands that read the inventory

    return load_inventory((ctx.obj or {}).get("inventory"))


def select(ctx: typer.Context, words: Optional[list[str]], all_hosts: bool = False,
           limit: Optional[str] = None) -> list[Host]:
    return inventory(ctx).select(words or [], all_hosts=all_hosts, limit=limit)


def select_one(ctx: typer.Context, word: str) -> Host:
    hosts = select(ctx, [word])
    if len(hosts) != 1:
        raise UsageError(f"{word!r} names {len(hosts)} hosts ({', '.join(h.name for h in hosts)}); "
                         "this command takes exactly one")
    return hosts[0]


_POOL: NodePool | None = None          # the running command's node connections (handle_errors)


@contextlib.contextmanager
def node_pool():
    """One SSH transport per node for the command that runs inside (closed at its end)."""
    global _POOL
    outer, _POOL = _POOL, NodePool()
    try:
        yield _POOL
    finally:
        pool, _POOL = _POOL, outer
        pool.close()


def node_transport(host: Host):
    """SSH transport of a container's Proxmox node: the inventory's `user`/`port` and `ssh_options`
    act like `ssh -l/-p/-o` over the ssh config ($DDTCTL_SSH_CONFIG, else ~/.ssh/config), which
    OpenSSH itself evaluates (remote/sshconfig.py). Inside a command the node's shared transport
    (`node_pool`); outside one a new transport."""
    if _POOL is not None:
        return _POOL.get(host.node_name, lambda: _new_node_transport(host))
    return _new_node_transport(host)


def _new_node_transport(host: Host):
    from ddtctl.remote.ssh import SshTransport      # paramiko is only imported when a node is used

    opts = {k: ("yes" if k.lower() == "stricthostkeychecking" and v.lower() == "strict" else v)
            for k, v in host.node.ssh_options.items()}
    return SshTransport(host.node.address, user=host.node.user, port=host.node.port, options=opts,
                        ssh_config=os.environ.get("DDTCTL_SSH_CONFIG") or None, name=f"node:{host.node_name}")


def transport_for(host: Host):
    """The Transport that reaches `host`: this machine, or `pct exec` through its node over SSH."""
    if host.kind == "local":
        from ddtctl.remote.transport import LocalTransport
        return LocalTransport(host.name)
    from ddtctl.remote.pct import ContainerTransport
    return ContainerTransport(node_transport(host), host.vmid, name=f"{host.name}@{host.node_name}")


def node_of(transport) -> Any:
    """The node transport under a container transport (None for local hosts)."""
    return getattr(transport, "node", None)


def home_error(exc: BaseException) -> UsageError | None:
    """A UsageError (exit 2) for an OSError on ddtctl's state directory ($DDTCTL_HOME, e.g.
    unwritable or not a directory); None for any other error."""
    if not isinstance(exc, OSError) or not exc.filename:
        return None
    home = os.path.abspath(ddtctl_home())
    path = os.path.abspath(os.fsdecode(exc.filename))
    if os.path.commonpath([home, path]) not in (home, path):
        return None
    return UsageError(f"ddtctl state directory {home} (DDTCTL_HOME) is not usable: "
                      f"{exc.strerror or exc}: {path}")


def handle_errors(fn: Callable) -> Callable:
    """Run a command the way every ddtctl command runs: a DdtctlError becomes a message on stderr
    + its exit code (no traceback for user mistakes); Ctrl-C is cooperative (cancel.py: exit 130
    after rollbacks and lock releases); a broken stdout/stderr pipe never stops the work
    (output.pipe_safe) and makes the exit code at least 1, Python's code for a broken pipe."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cancel.sigint_handler(), output.pipe_safe():
            with node_pool():
                code = _run_command(fn, args, kwargs)
            if cancel.was_requested():
                code = int(ExitCode.INTERRUPTED)
            elif output.output_lost():
                code = max(code, 1)
        if code:
            raise typer.Exit(code)
    return wrapper


def _run_command(fn: Callable, args, kwargs) -> int:
    from ddtctl import report        # rich: imported when a command runs, not for --help / --version

    try:
        fn(*args, **kwargs)
        return 0
    except typer.Exit as exc:
        return int(exc.exit_code or 0)
    except DdtctlError as exc:
        if cancel.was_requested() and not isinstance(exc, cancel.Interrupted):
            report.error(f"interrupted (Ctrl-C): {str(exc).splitlines()[0]}")
        else:
            report.error(str(exc))
        return int(exc.exit_code)
    except KeyboardInterrupt:
        report.error("interrupted")
        return int(ExitCode.INTERRUPTED)
    except OSError as exc:
        usage = home_error(exc)
        if usage is None:
            raise
        report.error(str(usage))
        return int(usage.exit_code)


def per_host(hosts: list[Host], fn: Callable[[Host, Any], Any], parallel: int) -> list[tuple[Host, Any, Exception | None]]:
    """Run fn(host, transport) for each host (thread pool); collect (host, value, error) in order.
    After Ctrl-C each host stops at its next step boundary (cancel.py) and is still collected."""
    from concurrent.futures import ThreadPoolExecutor

    def one(host: Host):
        transport = None
        try:
            transport = transport_for(host)
            return host, fn(host, transport), None
        except DdtctlError as exc:
            return host, None, exc
        except Exception as exc:  # noqa: BLE001 - an unexpected failure on one host must not hide the others
            usage = home_error(exc)
            if usage is not None:
                return host, None, usage
            return host, None, DdtctlError(f"{type(exc).__name__}: {exc}")
        finally:
            if transport is not None:
                transport.close()

    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(hosts)))) as pool:
        return [f.result() for f in [pool.submit(one, h) for h in hosts]]


def finish(errors: list[BaseException]) -> None:
    """Exit with the highest exit code among `errors` (0 when none)."""
    code = exit_code_for(errors)
    if code:
        raise typer.Exit(code)
