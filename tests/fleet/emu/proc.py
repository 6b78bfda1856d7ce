"""Process side of a service: its environment, spawning it, and killing its "control group".

Emulates systemd.exec(5):
* the environment a system service starts with: a fixed PATH, LANG, INVOCATION_ID, NOTIFY_SOCKET
  (when NotifyAccess= is not `none`), the manager's DefaultEnvironment= (/etc/systemd/system.conf,
  systemd-system.conf(5)), USER/LOGNAME/HOME/SHELL when User= is set, then
  Environment=, then EnvironmentFile= (files override Environment=; `-` prefix = optional file).
  Nothing of the caller's environment leaks in (systemd services never see the ssh session's env).
* WorkingDirectory= (default `/`; `-` prefix tolerates a missing directory), User=/Group=, stdin
  from /dev/null, stdout+stderr to the journal (a pipe read by the supervisor);
* spawn failures become the exit statuses of systemd.exec(5) "Process Exit Codes":
  200/CHDIR, 203/EXEC, 216/GROUP, 217/USER.
Emulates systemd.kill(5) KillMode=control-group without cgroups: the service runs in its own session
(setsid) and the supervisor is a child subreaper (prctl(2) PR_SET_CHILD_SUBREAPER), so "the control
group" is every process of that session plus every process re-parented to the supervisor, with
their descendants. A service that calls setsid() itself and double-forks can escape; real cgroups
would still catch it. KillMode=process|mixed|none are not emulated: every mode acts like
control-group.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import pwd
import signal
from typing import TYPE_CHECKING

from .syntax import expand_argv, extract_words
from .values import parse_env_file

if TYPE_CHECKING:
    import subprocess

# subprocess and ctypes are imported where used: only a unit's supervisor spawns, while every
# `systemctl show` (this module's readers) pays an emulator start-up per call
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SpawnError(Exception):
    def __init__(self, status: int, step: str, message: str):
        super().__init__(message)
        self.status, self.step, self.message = status, step, message


def default_environment(conf_path) -> dict[str, str]:
    """The manager's DefaultEnvironment= assignments of [Manager] in systemd-system.conf(5)
    (a missing file: none; later lines override earlier ones)."""
    try:
        text = open(conf_path).read()
    except OSError:
        return {}
    env, section = {}, ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Manager]" and line.startswith("DefaultEnvironment="):
            for word in extract_words(line.partition("=")[2]):
                key, sep, value = word.partition("=")
                if sep and key:
                    env[key] = value
    return env


def build_env(unit: dict, invocation: str, notify_socket: str | None,
              defaults: dict[str, str] | None = None) -> tuple[dict, list[str]]:
    """The service environment, and journal warnings. `defaults`: the manager's
    DefaultEnvironment=. Raises SpawnError(status=None) if a required EnvironmentFile= is missing
    (systemd: "Failed to load environment files")."""
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "INVOCATION_ID": invocation, **(defaults or {})}
    if notify_socket and unit["notify_access"] != "none":
        env["NOTIFY_SOCKET"] = notify_socket
    if unit["user"]:
        try:
            pw = pwd.getpwnam(unit["user"])
            env.update(USER=pw.pw_name, LOGNAME=pw.pw_name, HOME=pw.pw_dir, SHELL=pw.pw_shell)
        except KeyError:
            pass
    env.update(unit["environment"])
    warnings = []
    for path, optional in unit["environment_files"]:
        try:
            text = open(path).read()
        except OSError as exc:
            if optional and exc.errno == errno.ENOENT:
                continue
            raise SpawnError(-1, "ENVIRONMENT", f"Failed to load environment files: {exc.strerror}")
        values, warns = parse_env_file(text)
        env.update(values)
        warnings += [f"{path}: {w}" for w in warns]
    return env, warnings


def spawn(cmd: dict, unit: dict, env: dict, out_fd: int) -> subprocess.Popen:
    """Start one Exec*= command in a new session; raises SpawnError with systemd's exit status."""
    import subprocess

    argv = cmd["argv"] if cmd["no_env"] else expand_argv(cmd["argv"], env)
    cwd = "/"
    if unit["working_directory"]:
        wd, optional = unit["working_directory"]
        if os.path.isdir(wd):
            cwd = wd
        elif not optional:
            raise SpawnError(200, "CHDIR", "Changing to the requested working directory failed: "
                             "No such file or directory")
    kwargs = {}
    if unit["user"] and unit["user"] not in ("root", "0"):
        try:
            kwargs["user"] = pwd.getpwnam(unit["user"]).pw_uid
        except KeyError:
            raise SpawnError(217, "USER", "Failed to determine user credentials: No such process")
        try:
            kwargs["group"] = (grp.getgrnam(unit["group"]).gr_gid if unit["group"]
                               else pwd.getpwnam(unit["user"]).pw_gid)
        except KeyError:
            raise SpawnError(216, "GROUP", "Failed to determine group credentials: No such process")
        kwargs["extra_groups"] = []
    if not os.path.isabs(cmd["path"]):
        raise SpawnError(203, "EXEC", f"Failed to locate executable {cmd['path']}: No such file or directory")
    try:
        return subprocess.Popen(argv, executable=cmd["path"], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=out_fd, stderr=out_fd, start_new_session=True, **kwargs)
    except OSError as exc:
        raise SpawnError(203, "EXEC", f"Failed to execute {cmd['path']}: {exc.strerror}")


def set_subreaper() -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER


def _procs() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, session) for every live process visible here."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            data = open(f"/proc/{name}/stat").read()
        except OSError:
            continue
        fields = data[data.rindex(")") + 2:].split()
        if fields[0] not in ("Z", "X"):
            out[int(name)] = (int(fields[1]), int(fields[3]))
    return out


def cgroup_pids(session: int) -> list[int]:
    """Processes of the unit: its session, processes adopted by this supervisor, and descendants.
    A leader of ``session`` that is not this supervisor's child holds a reused number (the unit's
    main process, our child, has exited; pid_max is 32768 here): that session is somebody else's,
    e.g. the sshd session of the ``systemctl restart`` asking for the stop, and only adoption and
    descent count (the supervisor is a subreaper: the unit's leftovers are its children)."""
    me = os.getpid()
    procs = _procs()
    if session and session in procs and procs[session][0] != me:
        session = 0
    members = {pid for pid, (ppid, sid) in procs.items() if (session and sid == session) or ppid == me}
    changed = True
    while changed:
        new = {pid for pid, (ppid, _) in procs.items() if ppid in members and pid not in members}
        members |= new
        changed = bool(new)
    members.discard(me)
    return sorted(members)


def kill_cgroup(session: int, sig: int) -> list[int]:
    pids = cgroup_pids(session)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    return pids


def comm(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return "n/a"


def cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def decode_wait(status: int) -> tuple[int, int]:
    """waitpid status -> (ExecMainCode, ExecMainStatus): CLD_EXITED=1, CLD_KILLED=2, CLD_DUMPED=3."""
    if os.WIFEXITED(status):
        return 1, os.WEXITSTATUS(status)
    sig = os.WTERMSIG(status)
    return (3 if os.WCOREDUMP(status) else 2), sig


CLEAN_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE)
