"""`systemctl show` properties and the `systemctl status` page.

Emulates systemctl(1) `show`: `Key=value` lines (or bare values with `--value`), filtered by
`-p/--property` (repeatable, comma-separated). Like the real tool, properties come out in systemd's
D-Bus order -- org.freedesktop.systemd1.Service properties (Type, Restart, ..., MainPID,
StatusText, Result, NRestarts, ExecMain*) before org.freedesktop.systemd1.Unit ones (Id,
Description, LoadState, ActiveState, SubState, ...) -- NOT in the order they were requested, so
`show -p ActiveState,MainPID --value` prints MainPID's value first. Unknown properties are silently
skipped; a unit that does not exist still prints LoadState=not-found and exits 0.
`status` mimics the layout of systemd 252 (bullet, Loaded:, Active:, Main PID:, Status:, CGroup:,
last journal lines) for humans; tools should use `show`.
"""

from __future__ import annotations

import shlex
import time

from . import proc, state
from .values import format_timespan as span


def _exec(cmds: list[dict], st: dict, main: bool) -> str:
    parts = []
    for c in cmds:
        pid = st["ExecMainPID"] if main else 0
        stop = state.format_ts(st["ExecMainExitTimestamp"]) if main else ""
        parts.append(
            f"{{ path={c['path']} ; argv[]={' '.join(c['argv'])} ; ignore_errors={'yes' if c['ignore_failure'] else 'no'}"
            f" ; start_time=[{state.format_ts(st['ExecMainStartTimestamp']) if main else 'n/a'}]"
            f" ; stop_time=[{stop or 'n/a'}] ; pid={pid} ; code={_code(st) if main else '(null)'}"
            f" ; status={st['ExecMainStatus'] if main else 0}/0 }}")
    return " ".join(parts)


def _code(st: dict) -> str:
    return {0: "(null)", 1: "exited", 2: "killed", 3: "dumped"}.get(st["ExecMainCode"], "(null)")


def _env(env: dict) -> str:
    return " ".join(shlex.quote(f"{k}={v}") if any(c in v for c in " \t\"'") else f"{k}={v}"
                    for k, v in env.items())


def properties(u: dict, st: dict, file_state: str, need_reload: bool) -> list[tuple[str, str]]:
    """All properties in systemd's D-Bus order (Service interface first, then Unit)."""
    ts = state.format_ts
    loaded = u["load_state"] != "not-found"
    svc = [
        ("Type", u["type"]), ("ExitType", "main"), ("Restart", u["restart"]),
        ("NotifyAccess", u["notify_access"] or "none"), ("RestartUSec", span(u["restart_sec"])),
        ("TimeoutStartUSec", span(u["timeout_start"])), ("TimeoutStopUSec", span(u["timeout_stop"])),
        ("RuntimeMaxUSec", "infinity"), ("RemainAfterExit", "yes" if u["remain_after_exit"] else "no"),
        ("RestartPreventExitStatus", " ".join(map(str, u["restart_prevent"]))),
        ("SuccessExitStatus", " ".join(map(str, u["success_status"]))),
        ("MainPID", str(st["MainPID"])), ("ControlPID", "0"), ("StatusText", st["StatusText"]),
        ("StatusErrno", "0"), ("Result", st["Result"]), ("NRestarts", str(st["NRestarts"])),
        ("ExecMainStartTimestamp", ts(st["ExecMainStartTimestamp"])),
        ("ExecMainExitTimestamp", ts(st["ExecMainExitTimestamp"])),
        ("ExecMainPID", str(st["ExecMainPID"])), ("ExecMainCode", str(st["ExecMainCode"])),
        ("ExecMainStatus", str(st["ExecMainStatus"])),
        ("ExecStartPre", _exec(u["exec_start_pre"], st, False)), ("ExecStart", _exec(u["exec_start"], st, True)),
        ("ExecStartPost", _exec(u["exec_start_post"], st, False)),
        ("ControlGroup", f"/system.slice/{u['id']}" if st["ActiveState"] in state.RUNNING_STATES else ""),
        ("Environment", _env(u["environment"])),
        ("EnvironmentFiles", " ".join(f"{p} (ignore_errors={'yes' if o else 'no'})"
                                      for p, o in u["environment_files"])),
        ("WorkingDirectory", ("!" if u["working_directory"] and u["working_directory"][1] else "")
         + (u["working_directory"][0] if u["working_directory"] else "")),
        ("User", u["user"] or ""), ("Group", u["group"] or ""), ("KillMode", u["kill_mode"]),
        ("KillSignal", str(u["kill_signal"])), ("SendSIGKILL", "yes" if u["send_sigkill"] else "no"),
    ] if loaded else [("MainPID", "0"), ("Result", "success"), ("NRestarts", "0"), ("ExecMainStatus", "0")]
    unit = [
        ("Id", u["id"]), ("Names", u["id"]), ("Description", u["description"]),
        ("LoadState", u["load_state"]), ("ActiveState", st["ActiveState"]), ("SubState", st["SubState"]),
        ("FragmentPath", u["fragment"]), ("DropInPaths", " ".join(u["dropins"])),
        ("UnitFileState", file_state), ("StateChangeTimestamp", ts(st["StateChangeTimestamp"])),
        ("InactiveExitTimestamp", ts(st["InactiveExitTimestamp"])),
        ("ActiveEnterTimestamp", ts(st["ActiveEnterTimestamp"])),
        ("ActiveExitTimestamp", ts(st["ActiveExitTimestamp"])),
        ("InactiveEnterTimestamp", ts(st["InactiveEnterTimestamp"])),
        ("CanStart", "yes" if loaded else "no"), ("NeedDaemonReload", "yes" if need_reload else "no"),
        ("StartLimitIntervalUSec", span(u["start_limit_interval"])),
        ("StartLimitBurst", str(u["start_limit_burst"])), ("InvocationID", st["InvocationID"]),
    ]
    if u["load_error"]:
        unit.append(("LoadError", f"org.freedesktop.systemd1.BadUnitSetting \"{u['load_error']}\""))
    return svc + unit


def render_show(props: list[tuple[str, str]], wanted: list[str], value_only: bool, show_all: bool) -> str:
    lines = []
    for key, value in props:
        if wanted and key not in wanted:
            continue
        if not wanted and not value and not show_all:
            continue
        lines.append(value if value_only else f"{key}={value}")
    return "".join(line + "\n" for line in lines)


def _ago(t: float) -> str:
    d = max(0, int(time.time() - t))
    if d < 60:
        return f"{d}s ago"
    if d < 3600:
        return f"{d // 60}min {d % 60}s ago"
    return f"{d // 3600}h {d % 3600 // 60}min ago"


def render_status(u: dict, st: dict, file_state: str, journal_lines: list[str]) -> str:
    a, sub = st["ActiveState"], st["SubState"]
    bullet = {"active": "●", "failed": "×", "inactive": "○", "activating": "●", "deactivating": "●"}.get(a, "●")
    out = [f"{bullet} {u['id']} - {u['description']}"]
    if u["load_state"] == "loaded":
        out.append(f"     Loaded: loaded ({u['fragment']}; {file_state}; preset: enabled)")
    else:
        out.append(f"     Loaded: {u['load_state']} ({u['fragment'] or u['id']}; {file_state})")
    if u["dropins"]:
        out.append(f"    Drop-In: {' '.join(u['dropins'])}")
    # systemd 252 print_status_info(): the sub-state only when it differs from the active state,
    # the Result whenever it is not success, the timestamp of the state's last transition
    since = st["ActiveEnterTimestamp"] if a in ("active", "reloading") else \
        st["InactiveEnterTimestamp"] if a in ("inactive", "failed") else \
        st["InactiveExitTimestamp"] if a == "activating" else st["ActiveExitTimestamp"]
    result = f" (Result: {st['Result']})" if st["Result"] not in ("", "success") else ""
    when = f" since {state.format_ts(since)}; {_ago(since)}" if since else ""
    out.append(f"     Active: {a}{'' if sub == a else f' ({sub})'}{result}{when}")
    if st["MainPID"]:
        out.append(f"   Main PID: {st['MainPID']} ({proc.comm(st['MainPID'])})")
    elif st["ExecMainPID"]:
        out.append(f"    Process: {st['ExecMainPID']} ExecStart={u['exec_start'][0]['path']} "
                   f"({state.exit_status(st['ExecMainCode'], st['ExecMainStatus'])})")
    if st["StatusText"]:
        out.append(f'     Status: "{st["StatusText"]}"')
    if st["MainPID"]:
        out.append(f"     CGroup: /system.slice/{u['id']}")
        out.append(f"             └─{st['MainPID']} {proc.cmdline(st['MainPID'])}")
    if journal_lines:
        out.append("")
        out.extend(journal_lines)
    return "\n".join(out) + "\n"
