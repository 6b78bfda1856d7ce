"""ddtctl's local process supervisor: the service manager of `local` hosts (no systemd).

Starts the service detached in its own session (setsid), stdout+stderr appended to a log file,
pidfile + state JSON under $DDTCTL_HOME/supervisor/<host>/; stop = SIGTERM to the process group,
SIGKILL after a timeout; state from the pid (checked against its start time, so a reused pid is
not mistaken for the service). Same operations as ops/supervisor.py's SystemdManager.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from ddtctl.errors import RemoteError
from ddtctl.ops.units import ServiceSpec, render_local
from ddtctl.ops.unitstate import UnitState


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

    def __init__(self, state_dir: Path, stop_timeout_s: float = 150.0):
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
            raise RemoteError(f"local: no service installed at {self.spec_file} (run `ddtctl deploy`): {exc}") from None
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
        return UnitState("inactive", "dead", "success", 0, None,
                         load="loaded" if self.spec_file.exists() else "not-found")

    def diagnose(self) -> UnitState:
        """state() (no start limit here)."""
        return self.state()

    def log_tail(self, lines: int = 50) -> str:
        return self.logs(lines)

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
