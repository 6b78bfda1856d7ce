"""Service managers: systemd (argv run through a Transport) and ddtctl's local process supervisor.

Both expose the same operations so deploy/readiness/status never ask which one they have:
`unit_files(spec)` (path -> (text, mode) to install), `activate()` (after files changed),
`start/stop/restart`, `state()` -> UnitState, `logs(n)`.

systemd: `systemctl daemon-reload|enable|start|stop|restart UNIT`, `systemctl show UNIT -p ...`
(parsed as KEY=VALUE lines: with `--value` the output order follows systemd's D-Bus property order,
not the order asked for), `journalctl -u UNIT -n N --no-pager -o cat` (ops.md §3.6).

local: starts the service detached in its own session (setsid), stdout+stderr appended to a log
file, pidfile + state JSON under $DDTCTL_HOME/supervisor/<host>/; stop = SIGTERM to the process
group, SIGKILL after a timeout; state from the pid (checked against its start time, so a reused
pid is not mistaken for the service).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ddtctl.errors import RemoteError
from ddtctl.inventory import Host, ddtctl_home
from ddtctl.ops.units import ServiceSpec, render_env, render_local, render_unit, unit_path

SHOW_PROPS = ("ActiveState", "SubState", "Result", "NRestarts", "MainPID")


@dataclass(frozen=True)
class UnitState:
    """Service state. active: active | activating | deactivating | reloading | inactive | failed | unknown."""

    active: str
    sub: str = ""
    result: str = ""
    restarts: int = 0
    pid: int | None = None

    @property
    def failed(self) -> bool:
        return self.active == "failed" or self.result == "start-limit-hit"

    def to_dict(self) -> dict:
        return {**asdict(self), "failed": self.failed}


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


def parse_show(text: str) -> UnitState:
    """UnitState from `systemctl show -p ...` output (KEY=VALUE lines, any order)."""
    props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    pid = props.get("MainPID", "0")
    restarts = props.get("NRestarts", "0")
    return UnitState(active=props.get("ActiveState") or "unknown", sub=props.get("SubState", ""),
                     result=props.get("Result", ""), restarts=int(restarts) if restarts.isdigit() else 0,
                     pid=int(pid) if pid.isdigit() and int(pid) > 0 else None)


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
        self._run(systemctl_argv("start", self.unit))

    def stop(self) -> None:
        self._run(systemctl_argv("stop", self.unit))

    def restart(self) -> None:
        self._run(systemctl_argv("restart", self.unit))

    def state(self) -> UnitState:
        res = self.transport.run(show_argv(self.unit), timeout=60)
        return parse_show(res.text) if res.ok else UnitState("unknown")

    def logs(self, lines: int = 50) -> str:
        return self.transport.run(journal_argv(self.unit, lines), timeout=60).text

    def _run(self, argv: list[str]) -> None:
        self.transport.run(argv, timeout=300).check()


# ----------------------------------------------------------------------------- local supervisor

def _proc_start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks), None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _reap(pid: int) -> int | None:
    """Collect the exit status if `pid` is our own finished child (ddtctl started it in this run)."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if done else None


class LocalSupervisor:
    """Runs one service on this machine as a detached process group."""

    kind = "local"

    def __init__(self, state_dir: Path, stop_timeout_s: float = 90.0):
        self.dir = Path(state_dir)
        self.spec_file, self.state_file = self.dir / "service.json", self.dir / "state.json"
        self.pid_file, self.log_file = self.dir / "service.pid", self.dir / "service.log"
        self.stop_timeout_s = stop_timeout_s

    def unit_files(self, spec: ServiceSpec) -> dict[str, tuple[str, int]]:
        return {str(self.spec_file): (render_local(spec), 0o600)}

    def verify(self) -> str:
        return "unavailable"

    def activate(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        """Start the service unless it is already running. Raises RemoteError if it cannot exec."""
        if self.state().active == "active":
            return
        try:
            spec = json.loads(self.spec_file.read_text())
        except (OSError, ValueError) as exc:
            raise RemoteError(f"local: no service installed at {self.spec_file} (run `ddtctl deploy`): {exc}")
        env = {**os.environ, **spec["environment"], **spec["env_file_vars"]}
        env.pop("NOTIFY_SOCKET", None)
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            log.write(f"--- ddtctl start {time.strftime('%Y-%m-%d %H:%M:%S')}: {spec['argv'][0]}\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(spec["argv"], cwd=spec["working_dir"], env=env, stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                self._save(pid=None, desired="running", error=str(exc))
                raise RemoteError(f"local: cannot start {spec['argv'][0]}: {exc.strerror or exc}") from None
        proc.returncode = 0   # detached: keep Popen from reaping it behind our back; state() reaps it
        self.pid_file.write_text(f"{proc.pid}\n")
        self._save(pid=proc.pid, desired="running", start_time=_proc_start_time(proc.pid), argv=spec["argv"])

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after `stop_timeout_s`; no error if not running."""
        saved = self._load()
        pid = saved.get("pid")
        if pid and self._alive(saved):
            self._signal_group(pid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            while self._alive(saved) and time.monotonic() < deadline:
                time.sleep(0.2)
            if self._alive(saved):
                self._signal_group(pid, signal.SIGKILL)
                while self._alive(saved) and time.monotonic() < deadline + 10:
                    time.sleep(0.1)
            _reap(pid)
        self._save(pid=None, desired="stopped")
        self.pid_file.unlink(missing_ok=True)

    def restart(self) -> None:
        self.stop()
        self.start()

    def state(self) -> UnitState:
        saved = self._load()
        pid = saved.get("pid")
        if pid and self._alive(saved):
            return UnitState("active", "running", "success", 0, pid)
        if pid:                                   # it died on its own: remember how, once
            code = _reap(pid)
            saved.update(pid=None, exit_code=code if code is not None else saved.get("exit_code"))
            self._save(**saved)
        if saved.get("desired") == "running":
            code = saved.get("exit_code")
            return UnitState("failed", "dead", "exit-code" if code else "exited", 0, None)
        return UnitState("inactive", "dead", "success", 0, None)

    def logs(self, lines: int = 50) -> str:
        try:
            with open(self.log_file, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 256 * 1024))
                data = fh.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(data.splitlines()[-lines:]) + "\n" if data else ""

    # -- helpers
    def _alive(self, saved: dict) -> bool:
        pid = saved.get("pid")
        if not pid:
            return False
        now = _proc_start_time(pid)
        return now is not None and saved.get("start_time") in (None, now)

    @staticmethod
    def _signal_group(pid: int, sig: int) -> None:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass

    def _load(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def _save(self, **state) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({**state, "updated": time.time()}, indent=2))
        tmp.replace(self.state_file)


def supervisor_dir(host: Host) -> Path:
    """State directory of a local host's supervisor: $DDTCTL_HOME/supervisor/<host>."""
    return ddtctl_home() / "supervisor" / host.name


def manager_for(host: Host, transport) -> SystemdManager | LocalSupervisor:
    """The service manager of `host`: the local supervisor for local hosts, else systemd."""
    if host.kind == "local":
        return LocalSupervisor(supervisor_dir(host))
    return SystemdManager(transport, host.unit)
