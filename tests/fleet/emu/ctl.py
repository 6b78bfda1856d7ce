"""systemctl emulation: verbs, options, messages and exit codes of systemctl(1), as systemd 252
(Debian 12, Proxmox VE 8 containers) behaves.

Verbs: daemon-reload, daemon-reexec, enable/disable [--now], start/stop/restart/try-restart/
reload-or-restart/reload [--no-block], is-active, is-failed, is-enabled, status, show [-p ...]
[--value] [--all], cat, reset-failed, is-system-running [--wait] (always `running`).
Exit codes as systemctl(1) and systemctl's translate_bus_error_to_exit_status(): 0 success;
1 failed job / generic error / is-failed or is-enabled negative; 3 is-active/status "not active"
and reload "not applicable"; 4 `status`/`is-enabled` of a unit that does not exist; 5 unit not
found / not loaded for jobs; 6 bad unit file setting.
Jobs wait like a real `systemctl start`: Type=simple returns after the fork, Type=exec after the
exec, Type=notify after READY=1, Type=oneshot after the process exited; the job fails (exit 1,
"Job for X failed because ...") as soon as one attempt fails, even when Restart= then restarts
the unit in the background (systemd's unit_process_job()).
A start first passes the unit's start rate limit (ratelimit.py); a refused start fails the unit
(Result=start-limit-hit, or the earlier failure's Result: see state.start_limit_result) and the
job (exit 1, "Job for X failed." -- see JOB_FAILED for why 252 prints no reset-failed hint).
A unit file changed on disk without daemon-reload keeps its old loaded definition, and verbs warn
as systemd does. The unit's supervisor is forked into its own session with stdio on /dev/null, so
nothing holds the caller's stdout/stderr (an SSH channel would otherwise never close).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from . import ratelimit, show, state, unitfile
from .journal import unit_tail
from .paths import Paths

JOB_VERBS = ("start", "stop", "restart", "try-restart", "reload-or-restart", "reload")
FLAGS = {"--no-block", "--now", "--value", "-a", "--all", "-q", "--quiet", "--no-pager", "-l", "--full",
         "--plain", "--no-legend", "--system", "--wait", "-f", "--force", "--no-ask-password"}
# systemd 252 src/shared/bus-wait-for-jobs.c log_job_error_with_service_result(): the explanation
# for the service's Result=. Its key for the start limit is "start-limit", which no Result value
# matches (the Result is "start-limit-hit"), so a unit refused by its start limit gets the plain
# "Job for X failed." and the "To force a start use ..." hint is never printed (still so in 256).
JOB_FAILED = {
    "resources": "of unavailable resources or another system error",
    "protocol": "the service did not take the steps required by its unit configuration",
    "timeout": "a timeout was exceeded",
    "exit-code": "the control process exited with error code",
    "signal": "a fatal signal was delivered to the control process",
    "core-dump": "a fatal signal was delivered causing the control process to dump core",
    "watchdog": "the service failed to send watchdog ping",
    "start-limit": "start of the service was attempted too often",
}


def err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Ctl:
    def __init__(self, paths: Paths, opts: set, props: list[str], lines: int):
        self.p, self.opts, self.props, self.lines = paths, opts, props, lines

    # ---- loading ---------------------------------------------------------------------------------
    def unit(self, name: str, warn: bool = True) -> dict:
        snap = state.load_snapshot(self.p, name)
        if snap is None:
            u = unitfile.load(self.p, name)
            if u["load_state"] != "not-found":
                self._remember(u)
            return u
        if warn and snap["fingerprint"] != unitfile.fingerprint(self.p, name):
            err(f"Warning: The unit file, source configuration file or drop-ins of {name} changed on "
                "disk. Run 'systemctl daemon-reload' to reload units.")
        return snap

    def _remember(self, u: dict) -> None:
        state.save_snapshot(self.p, u)
        for w in u["warnings"]:
            state.journal(self.p, u["id"], w)
        if u["load_error"]:
            state.journal(self.p, u["id"], u["load_error"])

    def file_state(self, u: dict) -> str:
        if u["load_state"] == "not-found":
            return ""
        fresh = unitfile.load(self.p, u["id"]) if unitfile.fragment_for(self.p, u["id"]) else u
        if not fresh["has_install"]:
            return "static"
        links = [self.p.unit_dir / f"{t}.{kind}" / u["id"] for kind, ts in
                 (("wants", fresh["wanted_by"]), ("requires", fresh["required_by"])) for t in ts]
        return "enabled" if any(link.is_symlink() or link.exists() for link in links) else "disabled"

    def daemon_reload(self) -> int:
        """Reload every unit file; as in systemd 252, every unit's start rate limit starts afresh
        (ratelimit.py)."""
        for name in state.known_units(self.p):
            ratelimit.reset(self.p, name)
            u = unitfile.load(self.p, name)
            if u["load_state"] == "not-found":
                st = state.effective(state.read(self.p, name))
                if st["ActiveState"] not in state.RUNNING_STATES:
                    state.drop_snapshot(self.p, name)
                continue
            self._remember(u)
        return 0

    # ---- jobs ----------------------------------------------------------------------------------
    def check_loadable(self, verb: str, u: dict) -> int:
        name = u["id"]
        if u["load_state"] == "not-found":
            err(f"Failed to {verb} {name}: Unit {name} "
                f"{'not loaded' if verb in ('stop', 'reset failed state of') else 'not found'}.")
            return 5
        if u["load_state"] != "loaded" and verb != "stop":
            err(f"Failed to {verb} {name}: Unit {name} has a bad unit file setting.\n"
                f"See system logs and 'systemctl status {name}' for details.")
            return 6
        return 0

    def stop(self, u: dict) -> None:
        st = state.read(self.p, u["id"])
        if not state.supervisor_alive(st):
            return
        os.kill(st["supervisor"][0], signal.SIGTERM)
        deadline = time.time() + min(u["timeout_stop"], 3600) * 2 + 30
        while state.supervisor_alive(st) and time.time() < deadline:
            time.sleep(0.05)

    def start(self, u: dict) -> int:
        """Start under the unit lock: an exit code, or -1 when the caller must wait() for the job."""
        name = u["id"]
        st = state.effective(state.read(self.p, name))
        if st["ActiveState"] in ("active", "activating", "reloading"):
            return 0 if "--no-block" in self.opts else -1
        if not ratelimit.start_allowed(self.p, u):     # service_can_start(), before service_start()
            result = state.start_limit_result(st)
            state.journal(self.p, name, f"{name}: Start request repeated too quickly.")
            state.journal(self.p, name, f"{name}: Failed with result '{result}'.")
            state.journal(self.p, name, f"Failed to start {u['description']}.")
            state.set_state(st, "failed", "failed")
            st.update(Result=result, JobResult="failed", supervisor=None)
            state.write(self.p, name, st)
            return 0 if "--no-block" in self.opts else self.job_failed(name, result)
        st.update(NRestarts=0, Result="success", InvocationID=state.new_invocation(), MainPID=0,
                  JobResult=None)
        state.set_state(st, "activating", "start")
        self.fork_supervisor(u, st)
        return 0 if "--no-block" in self.opts else -1

    def fork_supervisor(self, u: dict, st: dict) -> None:
        from . import supervisor   # only starts need it (socket, ctypes, subprocess): imported per start

        r, w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
            os.setsid()
            os.close(w)
            os.read(r, 1)                                   # wait until the parent recorded us
            supervisor.run_forked(self.p, u)
        os.close(r)
        st["supervisor"] = [pid, state.proc_starttime(pid)]
        state.write(self.p, u["id"], st)
        os.close(w)

    def wait(self, u: dict, invocation: str) -> int:
        """Block until the start job of `invocation` is finished (see JobResult in supervisor.py)."""
        while True:
            st = state.effective(state.read(self.p, u["id"]))
            if st["InvocationID"] != invocation:
                return 0
            job = st.get("JobResult")
            if job == "done":
                return 0
            if job == "canceled":
                err(f"Job for {u['id']} canceled.")
                return 1
            if job or st["ActiveState"] == "failed":
                return self.job_failed(u["id"], job or st["Result"])
            time.sleep(0.05)

    def job_failed(self, name: str, result: str) -> int:
        """systemctl's message for a failed start job (see JOB_FAILED); exit status 1."""
        why = JOB_FAILED.get(result)
        msg = f"Job for {name} failed because {why}." if why else f"Job for {name} failed."
        err(f"{msg}\nSee \"systemctl status {name}\" and \"journalctl -xeu {name}\" for details.")
        if result == "start-limit":
            err(f"To force a start use \"systemctl reset-failed {name}\"\n"
                f"followed by \"systemctl start {name}\" again.")
        return 1

    def job(self, verb: str, name: str) -> int:
        """Run a job under the unit lock; a start is then awaited without holding the lock."""
        with state.locked(self.p, name):
            u, rc = self._job_locked(verb, name)
        if rc != -1:
            return rc
        return self.wait(u, state.read(self.p, name)["InvocationID"])

    def _job_locked(self, verb: str, name: str) -> tuple[dict, int]:
        u = self.unit(name)
        rc = self.check_loadable(verb, u)
        if rc:
            return u, rc
        st = state.effective(state.read(self.p, name))
        running = st["ActiveState"] in state.RUNNING_STATES
        if verb == "reload":
            err(f"Failed to reload {name}: Job type reload is not applicable for unit {name}.")
            return u, 3
        if verb == "stop":
            self.stop(u)
            return u, 0
        if verb == "try-restart" and not running:
            return u, 0
        if verb in ("restart", "try-restart", "reload-or-restart"):
            self.stop(u)
        return u, self.start(u)

    # ---- enable / disable ----------------------------------------------------------------------
    def enable(self, name: str, on: bool) -> int:
        u = unitfile.load(self.p, name)
        if u["load_state"] == "not-found":
            err(f"Failed to {'enable' if on else 'disable'} unit: Unit file {name} does not exist.")
            return 1
        if not u["has_install"]:
            err("The unit files have no installation config (WantedBy=, RequiredBy=, Also=,\n"
                "Alias= settings in the [Install] section, and DefaultInstance= for template\n"
                "units). This means they are not meant to be enabled or disabled using systemctl.")
        shown = lambda p: "/" + str(p.relative_to(self.p.root))   # noqa: E731 - paths as in the container
        if on:
            for kind, targets in (("wants", u["wanted_by"]), ("requires", u["required_by"])):
                for t in targets:
                    link = self.p.unit_dir / f"{t}.{kind}" / name
                    if link.is_symlink():
                        continue
                    link.parent.mkdir(parents=True, exist_ok=True)
                    target = "/" + str(unitfile.fragment_for(self.p, name).relative_to(self.p.root))
                    os.symlink(target, link)
                    err(f"Created symlink {shown(link)} → {target}.")
        else:
            dirs = [d for d in sorted(self.p.unit_dir.iterdir()) if d.suffix in (".wants", ".requires")]
            for link in (d / name for d in dirs):      # links may dangle outside the container view
                if link.is_symlink():
                    link.unlink()
                    err(f'Removed "{shown(link)}".')
        if "--now" in self.opts:
            return self.job("start" if on else "stop", name)
        return 0

    # ---- queries -------------------------------------------------------------------------------
    def query(self, verb: str, names: list[str]) -> int:
        quiet = bool({"-q", "--quiet"} & self.opts)
        hits = 0
        for name in names:
            u = self.unit(name, warn=False)
            if verb == "is-enabled":
                fs = self.file_state(u) or "not-found"
                hits += fs in ("enabled", "static")
                if not quiet:
                    print(fs)
                if fs == "not-found":
                    return 4
                continue
            st = state.effective(state.read(self.p, name))
            a = st["ActiveState"]
            if not quiet:
                print(a)
            hits += (a in ("active", "reloading")) if verb == "is-active" else (a == "failed")
        if hits:
            return 0
        return 3 if verb == "is-active" else 1

    def status(self, names: list[str]) -> int:
        rc = 0
        for i, name in enumerate(names):
            u = self.unit(name)
            if u["load_state"] == "not-found":
                err(f"Unit {name} could not be found.")
                rc = rc or 4
                continue
            st = state.effective(state.read(self.p, name))
            print(("\n" if i else "") + show.render_status(u, st, self.file_state(u),
                                                           unit_tail(self.p, name, self.lines)), end="")
            if st["ActiveState"] not in ("active", "reloading"):
                rc = rc or 3
        return rc

    def show(self, names: list[str]) -> int:
        out = []
        for name in names:
            u = self.unit(name, warn=False)
            st = state.effective(state.read(self.p, name))
            need = u["load_state"] != "not-found" and u["fingerprint"] != unitfile.fingerprint(self.p, name)
            props = show.properties(u, st, self.file_state(u), need)
            out.append(show.render_show(props, self.props, "--value" in self.opts,
                                        bool({"-a", "--all"} & self.opts)))
        sys.stdout.write("\n".join(out))
        return 0
