"""Bringing a service back: restart-until-ready with its own deadline, and `ddtctl rollback`.

* Every deliberate (re)start goes through the service manager's start/restart, which for systemd
  first runs `systemctl reset-failed UNIT`: a unit that hit its start rate limit (systemd.unit(5)
  StartLimitIntervalSec=/StartLimitBurst=, 5 starts in 600 s in ddtctl's units) is started anyway.
* A rollback waits for readiness under its OWN deadline (`rollback_timeout_s`, default the
  service's `ready_timeout_s`), never under the deadline given for the new release: a short
  `deploy --timeout` must not turn a healthy rollback into a failure.
* `rollback()` (the `ddtctl rollback` command) switches `current` to `previous`; when the previous
  release does not come back, it restores the links as they were (current = the release it
  started from, previous = the one it tried), restarts that release if it was running before,
  and reports the state the service ends in (`active (running)`, `failed [Result: exit-code;
  start limit hit]`, ...) in a RecoveryFailed that keeps the failure's exit code.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from ddtctl import cancel
from ddtctl.errors import DdtctlError, ExitCode, UsageError
from ddtctl.inventory import Host
from ddtctl.ops import logcause, releases
from ddtctl.ops.lock import host_lock
from ddtctl.ops.readiness import ReadyReport, wait_ready
from ddtctl.ops.supervisor import manager_for

RUNNING = ("active", "activating", "reloading")


class RecoveryFailed(DdtctlError):
    """A rollback (or a restart meant to bring a service back) failed; the message says which
    release the links point at and what state the service is in. exit_code: the cause's;
    rollback_result: the RollbackResult of `ddtctl rollback` (None for a deploy's rollback)."""

    def __init__(self, message: str, exit_code: int = ExitCode.HOST_FAILED):
        super().__init__(message)
        self.exit_code = ExitCode(exit_code)
        self.rollback_result: RollbackResult | None = None


def rollback_timeout(host: Host, timeout_s: float | None) -> float:
    """A rollback's readiness deadline in seconds: `timeout_s`, else the service's ready_timeout_s."""
    return host.service.ready_timeout_s if timeout_s is None else timeout_s


def restart_until_ready(host: Host, transport, manager, timeout_s: float) -> ReadyReport:
    """reset-failed + restart (via the manager), then wait-ready under `timeout_s` seconds.
    Raises what they raise (RemoteError, ReadinessTimeout, AuthError, Interrupted)."""
    manager.restart()
    return wait_ready(host, transport, manager, timeout_s=timeout_s)


def service_line(manager) -> str:
    """The service's state in words, the start limit included; never raises."""
    try:
        return manager.diagnose().describe()
    except DdtctlError as exc:
        return f"unknown ({str(exc).splitlines()[0]})"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass
class RollbackResult:
    """What `ddtctl rollback` did on one host (also its --json document)."""

    host: str
    from_release: str | None
    to_release: str | None
    current: str | None = None          # where `current` points afterwards
    service: str = ""                   # the service's state afterwards, in words
    ready: ReadyReport | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"host": self.host, "from": self.from_release, "to": self.to_release, "current": self.current,
                "service": self.service, "ready": self.ready.to_dict() if self.ready else None,
                "notes": self.notes}


def rollback(host: Host, transport, *, timeout_s: float | None = None, break_lock: bool = False) -> RollbackResult:
    """Switch `host` back to its previous release, restart it and wait until ready.

    Raises UsageError (exit 2) when there is no previous release, HostLocked when another run
    holds the host lock, RecoveryFailed (the cause's exit code) when the previous release does
    not come back (links restored, see the module docstring)."""
    layout = releases.Layout(host.root, host.unit)
    manager = manager_for(host, transport)
    deadline = rollback_timeout(host, timeout_s)
    with host_lock(transport, host.root, "rollback", break_lock=break_lock):
        target = releases.read_link(transport, layout.previous)
        start = releases.read_link(transport, layout.current)
        if target is None or target == start:
            raise UsageError(f"{host.name}: no previous release to roll back to")
        before = manager.state()
        releases.switch(transport, layout, target)
        result = RollbackResult(host.name, start, target, current=target)
        try:
            result.ready = restart_until_ready(host, transport, manager, deadline)
            result.service = service_line(manager)
            return result
        except DdtctlError as exc:
            raise _undo(host, transport, manager, layout, result, before.active in RUNNING, deadline, exc) from None


def _undo(host, transport, manager, layout, result: RollbackResult, was_running: bool, deadline: float,
          cause: DdtctlError) -> RecoveryFailed:
    """Links back to where the rollback started; that release restarted if it was running."""
    lines = [f"{host.name}: rollback to {result.to_release} failed: {first_line(cause)}"]
    tail = "" if isinstance(cause, cancel.Interrupted) else logcause.explain(manager.log_tail(80)).rstrip()
    try:
        if result.from_release:
            releases.switch(transport, layout, result.from_release, keep_previous=False)
            releases.restore_previous(transport, layout, result.to_release)
            result.current = result.from_release
            lines.append(f"links restored: current -> {result.from_release}, previous -> {result.to_release}")
        if was_running and result.from_release:
            if cancel.requested():
                manager.restart()
                lines.append(f"{result.from_release} restarted (not waited for: interrupted)")
            else:
                restart_until_ready(host, transport, manager, deadline)
                lines.append(f"{result.from_release} restarted and ready")
    except DdtctlError as exc:
        lines.append(f"restoring {result.from_release} failed too: {first_line(exc)}")
    result.service = service_line(manager)
    lines.append(f"service {host.unit}: {result.service} (current release: {result.current})")
    result.notes = lines[1:]
    if tail:
        lines.append(f"service log when the rollback failed:\n{tail}")
    error = RecoveryFailed("\n".join(lines), cause.exit_code)
    error.rollback_result = result
    return error


_PORT = re.compile(r'(?:^|[\s"\[,])--port["\s,]+"?(\d+)')
_NAME = re.compile(r'(?:^|[\s"\[,])--served-model-name["\s,]+"((?:[^"\\]|\\.)*)"|--served-model-name\s+(\S+)')


def restored_host(host: Host, restored: dict[str, tuple[str, int]]) -> Host:
    """`host` as the older unit files a rollback put back describe it: their `--port` and
    `--served-model-name` (the unit's ExecStart, or the local supervisor's argv), so the rollback
    waits for the service where it really is and the deploy reports that URL, not the new
    inventory's values. `host` itself when the files name no port."""
    for text, _mode in restored.values():
        port = _PORT.search(text)
        if port is None:
            continue
        name = _NAME.search(text)
        update = {"port": int(port.group(1))}
        if name:
            update["model_id"] = name.group(1) if name.group(1) is not None else name.group(2)
        return dataclasses.replace(host, service=host.service.model_copy(update=update))
    return host
