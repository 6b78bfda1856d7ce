"""One supervisor process per started unit: what PID 1 does for a service, minus cgroups.

Emulates systemd.service(5) for Type=simple|exec|notify|oneshot (forking/idle/dbus behave as
simple): ExecStartPre= / ExecStart= / ExecStartPost= with the `-` prefix, NOTIFY_SOCKET (an
AF_UNIX datagram socket; READY=1, STATUS=, STOPPING=1, checked against NotifyAccess= via
SCM_CREDENTIALS), TimeoutStartSec= (Result=timeout), Restart= with RestartSec=,
RestartPreventExitStatus=, SuccessExitStatus=, the start rate limit of systemd.unit(5) as systemd
252 applies it to automatic restarts (ratelimit.py; a refused restart fails the unit, keeping the
failed run's Result, see state.start_limit_result), NRestarts (reset by reset-failed), and
systemd.kill(5) stopping: KillSignal= to the control group, TimeoutStopSec=, then SIGKILL
(SendSIGKILL=). JobResult records how the pending start job ended, as unit_process_job() in
systemd's src/core/unit.c decides it: "done" when the unit first becomes active; the Result of the
first failed attempt otherwise -- the unit passes through the failed state before an automatic
restart, which fails the start job even though restarts continue in the background. The journal gets systemd's own messages ("Starting ...", "Main process exited,
code=exited, status=1/FAILURE", "Scheduled restart job, restart counter is at N.", ...) and every
line the service writes to stdout/stderr. A stop request is SIGTERM to the supervisor;
`systemctl reset-failed` of a running unit is SIGUSR1 (service_reset_failed(): NRestarts=0,
Result=success).
"""

from __future__ import annotations

import os
import signal
import time
import traceback

from . import proc, ratelimit, state
from .paths import Paths
from .svio import ServiceIO


class Supervisor(ServiceIO):
    # ---- running commands ----------------------------------------------------------------------
    def start_process(self, cmd: dict, env: dict) -> int:
        """Spawn; returns the pid, or records a synthetic exit (203/EXEC etc.) and returns -1."""
        try:
            p = proc.spawn(cmd, self.u, env, self.pipe_w)
        except proc.SpawnError as exc:
            self.log(exc.message)
            self.log(f"Failed at step {exc.step} spawning {cmd['path']}: {exc.message.rsplit(': ', 1)[-1]}")
            self.exited[-1] = exc.status << 8
            return -1
        p.returncode = 0          # the supervisor reaps with waitpid(-1); keep Popen quiet
        return p.pid

    def run_control(self, cmd: dict, env: dict, deadline: float) -> str:
        """ExecStartPre=/ExecStartPost=: run to completion; returns a Result string."""
        pid = self.start_process(cmd, env)
        while pid not in self.exited:
            if self.stop_requested or time.time() > deadline:
                proc.kill_cgroup(0, signal.SIGKILL)
                return "timeout" if not self.stop_requested else "success"
            self.pump()
        code, status = proc.decode_wait(self.exited.pop(pid))
        if (code, status) != (1, 0) and not cmd["ignore_failure"]:
            self.log(f"Control process exited, {state.exit_status(code, status)}")
            return "exit-code" if code == 1 else "signal"
        return "success"

    def main_result(self, code: int, status: int, cmd: dict) -> str:
        clean = (code == 1 and (status == 0 or status in self.u["success_status"])) or \
                (code == 2 and status in proc.CLEAN_SIGNALS)
        if clean or cmd["ignore_failure"]:
            if self.u["type"] == "notify" and not self.ready and not self.stop_requested:
                return "protocol"
            return "success"
        return {1: "exit-code", 2: "signal", 3: "core-dump"}[code]

    def kill_rest(self, first_signal: int) -> bool:
        """Signal the control group, wait TimeoutStopSec=, then SIGKILL. True if SIGKILL was needed."""
        session = self.main_pid if self.main_pid > 0 else 0
        if not proc.kill_cgroup(session, first_signal):
            return False
        deadline = time.time() + self.u["timeout_stop"]
        while time.time() < deadline:
            self.pump(0.1)
            if not proc.cgroup_pids(session):
                return False
        if not self.u["send_sigkill"]:
            return False
        for pid in proc.kill_cgroup(session, signal.SIGKILL):
            self.log(f"Killing process {pid} ({proc.comm(pid)}) with signal SIGKILL.")
        for _ in range(50):
            self.pump(0.1)
            if not proc.cgroup_pids(session):
                break
        return True

    def one_run(self) -> tuple[str, bool]:
        """Start the service once and supervise it until it ends. Returns (Result, stopped_by_request)."""
        u, desc = self.u, self.u["description"]
        self.ready, self.main_pid, self.was_active = False, 0, False
        self.set("activating", "start-pre" if u["exec_start_pre"] else "start", Result="success",
                 StatusText="", MainPID=0)
        state.journal(self.p, self.name, f"Starting {desc}...")
        try:
            env, warnings = proc.build_env(u, self.st["InvocationID"], self.notify_addr,
                                           proc.default_environment(self.p.manager_conf))
        except proc.SpawnError as exc:
            self.log(exc.message)
            self.log("Failed to spawn 'start' task: No such file or directory")
            return "resources", False
        for w in warnings:
            self.log(w)
        deadline = time.time() + u["timeout_start"]
        for cmd in u["exec_start_pre"]:
            result = self.run_control(cmd, env, deadline)
            if result != "success" or self.stop_requested:
                return result, self.stop_requested
        cmd = u["exec_start"][0]
        if u["type"] in ("simple", "idle", "forking", "dbus"):
            self.set("active", "running")
            state.journal(self.p, self.name, f"Started {desc}.")
        else:
            self.set("activating", "start")
        self.main_pid = self.start_process(cmd, env)
        now = time.time()
        self.save(MainPID=max(self.main_pid, 0), ExecMainPID=max(self.main_pid, 0),
                  ExecMainStartTimestamp=now, ExecMainExitTimestamp=0.0, ExecMainCode=0, ExecMainStatus=0)
        if self.main_pid > 0 and u["type"] == "exec":
            self.set("active", "running")
            state.journal(self.p, self.name, f"Started {desc}.")
        stopped_by_request, timed_out = False, False
        while self.main_pid not in self.exited:
            if self.stop_requested and not stopped_by_request:
                stopped_by_request = True
                self.set("deactivating", "stop-sigterm")
                state.journal(self.p, self.name, f"Stopping {desc}...")
                if self.kill_rest(u["kill_signal"]):
                    self.log("State 'stop-sigterm' timed out. Killing.")
                    timed_out = True
                continue
            if self.st["ActiveState"] == "activating" and time.time() > deadline:
                self.log("start operation timed out. Terminating.")
                self.kill_rest(signal.SIGTERM)
                timed_out = True
                continue
            if self.ready and self.st["ActiveState"] == "activating" and u["type"] == "notify":
                for post in u["exec_start_post"]:
                    if self.run_control(post, env, deadline) != "success":
                        self.stop_requested = True
                if not self.stop_requested:
                    self.set("active", "running")
                    state.journal(self.p, self.name, f"Started {desc}.")
            self.pump()
        code, status = proc.decode_wait(self.exited.pop(self.main_pid))
        self.read_output(final=True)
        self.save(ExecMainCode=code, ExecMainStatus=status, ExecMainExitTimestamp=time.time(), MainPID=0)
        result = "timeout" if timed_out else self.main_result(code, status, cmd)
        if result != "success":           # systemd logs clean exits at debug level only
            self.log(f"Main process exited, {state.exit_status(code, status)}")
        self.kill_rest(u["kill_signal"])
        return result, stopped_by_request

    def should_restart(self, result: str) -> bool:
        mode, st = self.u["restart"], self.st
        if st["ExecMainCode"] == 1 and st["ExecMainStatus"] in self.u["restart_prevent"]:
            return False
        return (mode == "always" or (mode == "on-success" and result == "success")
                or (mode == "on-failure" and result != "success")
                or (mode == "on-abnormal" and result in ("signal", "core-dump", "timeout"))
                or (mode == "on-abort" and result in ("signal", "core-dump")))

    def finish(self, result: str) -> None:
        desc = self.u["description"]
        if self.st.get("JobResult") is None:
            self.st["JobResult"] = "canceled" if self.stop_requested else (
                "done" if result == "success" else result)
        if result == "success":
            if self.u["type"] == "oneshot" and self.u["remain_after_exit"] and not self.stop_requested:
                self.set("active", "exited")
                return
            self.log("Deactivated successfully.")
            self.set("inactive", "dead", Result="success")
        else:
            self.log(f"Failed with result '{result}'.")
            self.set("failed", "failed", Result=result)
        if self.stop_requested:
            state.journal(self.p, self.name, f"Stopped {desc}.")
        elif result != "success" and not self.was_active:
            state.journal(self.p, self.name, f"Failed to start {desc}.")

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop_requested", True))
        signal.signal(signal.SIGUSR1, lambda *_: setattr(self, "reset_requested", True))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGUSR1})  # blocked since the fork
        proc.set_subreaper()
        self.st = state.read(self.p, self.name)
        self.open_notify()
        while True:
            result, _ = self.one_run()
            if self.stop_requested or not self.should_restart(result):
                self.finish(result)
                return
            if result != "success":
                self.log(f"Failed with result '{result}'.")
            if self.st.get("JobResult") is None:           # the unit passed through "failed": the
                self.st["JobResult"] = result              # start job fails, restarts go on anyway
            self.set("activating", "auto-restart", Result=result)
            wake = time.time() + self.u["restart_sec"]
            while time.time() < wake and not self.stop_requested:
                self.pump(min(0.2, max(0.0, wake - time.time())))
            if self.stop_requested:
                self.set("inactive", "dead")
                state.journal(self.p, self.name, f"Stopped {self.u['description']}.")
                return
            self.st["NRestarts"] += 1
            self.log(f"Scheduled restart job, restart counter is at {self.st['NRestarts']}.")
            state.journal(self.p, self.name, f"Stopped {self.u['description']}.")
            if not ratelimit.start_allowed(self.p, self.u):
                result = state.start_limit_result(self.st)
                self.log("Start request repeated too quickly.")
                self.log(f"Failed with result '{result}'.")
                self.set("failed", "failed", Result=result)
                state.journal(self.p, self.name, f"Failed to start {self.u['description']}.")
                return
            snap = state.load_snapshot(self.p, self.name)   # an automatic restart uses the unit
            if snap and snap["load_state"] == "loaded":      # as loaded now (after daemon-reload)
                self.u = snap


def run_forked(paths: Paths, unit: dict) -> None:
    """Entry point in the forked child: detach from the caller's stdio and every inherited fd (an
    SSH channel stays open while any process holds it), supervise, never return."""
    code = 0
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        Supervisor(paths, unit).run()
    except BaseException:                           # noqa: BLE001 - report, never leak to the caller
        state.journal(paths, unit["id"], "emulation error: " + traceback.format_exc())
        code = 1
    finally:
        os._exit(code)
