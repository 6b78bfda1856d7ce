"""Service managers: systemd (argv run through a Transport) and ddtctl's local process supervisor.

Both expose the same operations so deploy/readiness/status never ask which one they have:
`unit_files(spec)` (path -> (text, mode) to install), `activate()` (after files changed),
`start/stop/restart`, `state()` / `diagnose()` -> UnitState, `logs(n)` (raises when there is
no log to read) and `log_tail(n)` (for error messages, never raises).

systemd: `systemctl daemon-reload|enable|start|stop|restart UNIT` (start and restart after
`systemctl reset-failed UNIT`, so a deliberate start is never refused by the unit's start rate
limit, systemd.unit(5) StartLimitBurst=), `systemctl show UNIT -p ...`
(parsed as KEY=VALUE lines: with `--value` the output order follows systemd's D-Bus property order,
not the order asked for), `journalctl -u UNIT -n N --no-pager -o cat`.

local: ops/local_supervisor.py (a detached process group, its log file and a state file).
UnitState and the parsers live in ops/unitstate.py (re-exported here).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ddtctl.errors import DdtctlError, RemoteError
from ddtctl.inventory import Host, ddtctl_home
from ddtctl.ops.container import pct_failure
from ddtctl.ops.local_supervisor import LocalSupervisor
from ddtctl.ops.units import ServiceSpec, render_env, render_unit, unit_path
from ddtctl.ops.unitstate import UnitState, parse_show, start_limit_in_journal

__all__ = ["LocalSupervisor", "SystemdManager", "UnitState", "manager_for", "parse_show", "start_limit_in_journal",
           "supervisor_dir"]

SHOW_PROPS = ("LoadState", "ActiveState", "SubState", "Result", "NRestarts", "MainPID")


# ----------------------------------------------------------------------------- systemd

def systemctl_argv(verb: str, unit: str | None = None) -> list[str]:
    """`systemctl VERB [UNIT]` (daemon-reload takes no unit)."""
    return ["systemctl", verb] if unit is None else ["systemctl", verb, unit]


def show_argv(unit: str) -> list[str]:
    return ["systemctl", "show", unit, "-p", ",".join(SHOW_PROPS)]


def journal_argv(unit: str, lines: int) -> list[str]:
    return ["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"]


def verify_argv(path: str) -> list[str]:
    return ["systemd-analyze", "verify", path]


class SystemdManager:
    """A systemd unit on the far side of `transport` (a container, or a node)."""

    kind = "systemd"

    def __init__(self, transport, unit: str):
        self.transport, self.unit = transport, unit

    def unit_files(self, spec: ServiceSpec) -> dict[str, tuple[str, int]]:
        return {unit_path(spec.unit): (render_unit(spec), 0o644), spec.env_file: (render_env(spec), 0o600)}

    def verify(self) -> str:
        """Run `systemd-analyze verify` on the installed unit: "ok", or "unavailable" without the tool.

        Raises RemoteError with systemd's message when the unit is rejected."""
        res = self.transport.run(verify_argv(unit_path(self.unit)), timeout=120)
        if res.exit_code in (126, 127) and not res.stdout:
            return "unavailable"
        res.check()
        return "ok"

    def activate(self) -> None:
        """daemon-reload, then enable (both idempotent)."""
        self._run(systemctl_argv("daemon-reload"))
        self._run(systemctl_argv("enable", self.unit))

    def start(self) -> None:
        """reset-failed, then start: a deliberate start is never refused by the start limit."""
        self._reset_failed()
        self._run(systemctl_argv("start", self.unit))

    def stop(self) -> None:
        self._run(systemctl_argv("stop", self.unit))

    def restart(self) -> None:
        """reset-failed, then restart (see start)."""
        self._reset_failed()
        self._run(systemctl_argv("restart", self.unit))

    def state(self) -> UnitState:
        # reads (here and the journal below): a connection lost under them is reconnected once and
        # the read repeated (remote/ssh.py), so one dropped connection does not fail a readiness poll
        res = self.transport.run(show_argv(self.unit), timeout=60, idempotent=True)
        return parse_show(res.text) if res.ok else UnitState("unknown")

    def diagnose(self) -> UnitState:
        """state(), plus whether the start limit refused the last start (read from the journal)."""
        st = self.state()
        if st.active != "failed" or st.result == "start-limit-hit":
            return st
        res = self.transport.run(journal_argv(self.unit, 40), timeout=60, idempotent=True)
        return replace(st, start_limit_hit=res.ok and start_limit_in_journal(res.text, self.unit))

    def logs(self, lines: int = 50) -> str:
        """The last `lines` journal lines. Raises RemoteError (pct's own message when the
        container is stopped or missing) when journalctl cannot be run."""
        res = self.transport.run(journal_argv(self.unit, lines), timeout=60, idempotent=True)
        if not res.ok:
            why = pct_failure(res.exit_code, res.err_text)
            if why is not None:
                last = res.err_text.strip().splitlines()[-1]
                raise RemoteError(f"{self.transport.name}: {why.detail}: {last}", res)
            res.check()
        return res.text

    def log_tail(self, lines: int = 50) -> str:
        """logs() for error messages: never raises (says why there is no log instead)."""
        try:
            return self.logs(lines)
        except DdtctlError as exc:
            return f"(no service log: {str(exc).splitlines()[0]})\n"

    def _reset_failed(self) -> None:
        """`systemctl reset-failed UNIT` (systemctl(1)): failed -> inactive and the start rate limit
        forgotten. Its exit status is ignored: a unit that was never loaded has nothing to reset
        (exit 1, "Unit X not loaded."), and a transport problem shows in the start that follows."""
        self.transport.run(systemctl_argv("reset-failed", self.unit), timeout=60)

    def _run(self, argv: list[str]) -> None:
        self.transport.run(argv, timeout=300).check()


def supervisor_dir(host: Host) -> Path:
    """State directory of a local host's supervisor: $DDTCTL_HOME/supervisor/<host>."""
    return ddtctl_home() / "supervisor" / host.name


def manager_for(host: Host, transport) -> SystemdManager | LocalSupervisor:
    """The service manager of `host`: the local supervisor for local hosts, else systemd."""
    if host.kind == "local":
        return LocalSupervisor(supervisor_dir(host))
    return SystemdManager(transport, host.unit)
