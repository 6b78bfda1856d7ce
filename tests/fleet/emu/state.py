"""Persistent unit state, loaded-unit snapshots and the per-unit journal (the start rate limit: ratelimit.py).

Real systemd keeps all of this in PID 1's memory and the journal. The emulation has no PID 1, so a
unit's runtime properties (the ones `systemctl show` prints: ActiveState, SubState, Result,
NRestarts, MainPID, ExecMainCode/ExecMainStatus, timestamps, StatusText) live in one JSON file per
unit, written atomically (write + rename) by whichever process owns the unit at that moment: the
unit's supervisor while one is alive, otherwise `systemctl` under the unit's flock.

If a supervisor dies without recording a final state (e.g. killed by a test teardown), readers see
the unit as `failed` with Result=resources, the result systemd itself uses for unit-internal errors.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time

from .paths import Paths

DEFAULT = {
    "ActiveState": "inactive", "SubState": "dead", "Result": "success", "NRestarts": 0, "MainPID": 0,
    "ExecMainPID": 0, "ExecMainCode": 0, "ExecMainStatus": 0, "ExecMainStartTimestamp": 0.0,
    "ExecMainExitTimestamp": 0.0, "ActiveEnterTimestamp": 0.0, "ActiveExitTimestamp": 0.0,
    "InactiveEnterTimestamp": 0.0, "InactiveExitTimestamp": 0.0, "StateChangeTimestamp": 0.0,
    "StatusText": "", "InvocationID": "", "supervisor": None, "JobResult": None,
}
RUNNING_STATES = ("active", "activating", "deactivating", "reloading")
EXIT_NAMES = {0: "SUCCESS", 1: "FAILURE", 2: "INVALIDARGUMENT", 3: "NOTIMPLEMENTED", 4: "NOPERMISSION",
              5: "NOTINSTALLED", 6: "NOTCONFIGURED", 7: "NOTRUNNING", 200: "CHDIR", 203: "EXEC",
              216: "GROUP", 217: "USER", 226: "NAMESPACE"}


def read(paths: Paths, unit: str) -> dict:
    try:
        data = json.loads(paths.state_file(unit).read_text())
    except (OSError, ValueError):
        data = {}
    return {**DEFAULT, **data}


def write(paths: Paths, unit: str, st: dict) -> None:
    paths.ensure()
    target = paths.state_file(unit)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(st, indent=1, sort_keys=True))
    os.replace(tmp, target)


def set_state(st: dict, active: str, sub: str) -> None:
    """Update Active/SubState and the *Timestamp properties the way unit_notify() does."""
    now, old = time.time(), st["ActiveState"]
    if active != old:
        if old == "active":
            st["ActiveExitTimestamp"] = now
        if active == "active":
            st["ActiveEnterTimestamp"] = now
        if old in ("inactive", "failed") and active not in ("inactive", "failed"):
            st["InactiveExitTimestamp"] = now
        if active in ("inactive", "failed") and old not in ("inactive", "failed"):
            st["InactiveEnterTimestamp"] = now
    st["ActiveState"], st["SubState"], st["StateChangeTimestamp"] = active, sub, now


def new_invocation() -> str:
    import uuid           # here: one start in many calls needs it (emulator start-up is per call)

    return uuid.uuid4().hex


@contextlib.contextmanager
def locked(paths: Paths, unit: str):
    """Serialise systemctl verbs on one unit (systemd serialises jobs per unit)."""
    paths.ensure()
    with open(paths.lock_file(unit), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def proc_starttime(pid: int) -> int | None:
    try:
        data = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def supervisor_alive(st: dict) -> bool:
    sup = st.get("supervisor")
    return bool(sup) and proc_starttime(sup[0]) == sup[1]


def effective(st: dict) -> dict:
    """The state as readers should see it (see the module docstring about lost supervisors)."""
    if st["ActiveState"] in RUNNING_STATES and not supervisor_alive(st):
        st = {**st, "ActiveState": "failed", "SubState": "failed", "Result": "resources", "MainPID": 0}
    return st


def start_limit_result(st: dict) -> str:
    """Result= of a start refused by the start limit. systemd 252's service_can_start() calls
    service_enter_dead(SERVICE_FAILURE_START_LIMIT_HIT), which keeps an earlier failure's result
    (`if (s->result == SERVICE_SUCCESS) s->result = f;`): a unit whose last run failed with
    exit-code stays Result=exit-code (the journal still says "Start request repeated too
    quickly."); only a unit whose last run ended cleanly gets Result=start-limit-hit."""
    return st["Result"] if st["Result"] not in ("", "success") else "start-limit-hit"


def exit_status(code: int, status: int) -> str:
    """`code=exited, status=1/FAILURE` / `code=killed, status=15/TERM` as systemd logs them."""
    if code == 1:
        return f"code=exited, status={status}/{EXIT_NAMES.get(status, 'n/a')}"
    try:
        name = signal.Signals(status).name[3:]
    except ValueError:
        name = "n/a"
    return f"code={'dumped' if code == 3 else 'killed'}, status={status}/{name}"


def journal(paths: Paths, unit: str, msg: str, *, ident: str = "systemd", pid: int = 1,
            ts: float | None = None) -> None:
    """Append one record; a single O_APPEND write per record keeps concurrent writers intact."""
    paths.ensure()
    rec = {"ts": time.time() if ts is None else ts, "host": os.uname().nodename, "ident": ident,
           "pid": pid, "unit": unit, "msg": msg}
    fd = os.open(paths.journal_file(unit), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)


def format_ts(ts: float) -> str:
    """`Mon 2025-06-09 10:00:00 UTC` as systemctl show/status print timestamps; empty when unset."""
    return time.strftime("%a %Y-%m-%d %H:%M:%S %Z", time.localtime(ts)) if ts else ""


def load_snapshot(paths: Paths, unit: str) -> dict | None:
    try:
        return json.loads(paths.loaded_file(unit).read_text())
    except (OSError, ValueError):
        return None


def save_snapshot(paths: Paths, unit: dict) -> None:
    paths.ensure()
    target = paths.loaded_file(unit["id"])
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(unit, indent=1))
    os.replace(tmp, target)


def drop_snapshot(paths: Paths, unit: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        paths.loaded_file(unit).unlink()


def known_units(paths: Paths) -> list[str]:
    """Units that have a file on disk or a loaded snapshot."""
    names = set()
    if paths.unit_dir.is_dir():
        names |= {p.name for p in paths.unit_dir.glob("*.service") if p.is_file() and "@." not in p.name}
    if paths.state_dir.is_dir():
        names |= {p.name[: -len(".loaded.json")] for p in paths.state_dir.glob("*.loaded.json")}
    return sorted(names)


def kill_all(paths: Paths, timeout: float = 10.0) -> None:
    """Test teardown: stop every supervisor of this root (SIGTERM, then SIGKILL its process group)."""
    if not paths.state_dir.is_dir():
        return
    sups = []
    for f in paths.state_dir.glob("*.state.json"):
        st = read(paths, f.name[: -len(".state.json")])
        if supervisor_alive(st):
            sups.append(st)
            os.kill(st["supervisor"][0], signal.SIGTERM)
    deadline = time.time() + timeout
    while sups and time.time() < deadline and any(supervisor_alive(s) for s in sups):
        time.sleep(0.1)
    for st in sups:
        for pid in (st["supervisor"][0], st["MainPID"]):
            if pid and (pid != st["supervisor"][0] or supervisor_alive(st)):
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
