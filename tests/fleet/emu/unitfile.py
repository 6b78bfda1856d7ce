"""Load a service unit file (plus drop-ins) into a JSON-serialisable dict, as systemd's unit loader does.

Emulates systemd.syntax(7) (sections, `Key=Value`, `#`/`;` comments, trailing-backslash line
continuation, an empty assignment resets list settings), systemd.unit(5) (load path
/etc/systemd/system, `<unit>.d/*.conf` drop-ins, template `name@.service` for `name@inst.service`,
specifiers resolved at load time in Exec*=, Environment=, EnvironmentFile=, WorkingDirectory=) and
the parts of systemd.service(5)/systemd.exec(5)/systemd.kill(5) that matter for running a server.
Load errors the real loader treats as fatal (no ExecStart=, several ExecStart= outside
Type=oneshot, a bad specifier in a command line) give LoadState=bad-setting; unknown keys only warn.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from .paths import Paths
from .syntax import SyntaxErr, extract_words, resolve_specifiers, specifiers
from .values import parse_bool, parse_timespan

IGNORED_KEYS = {
    "Unit": {"Documentation", "After", "Before", "Wants", "Requires", "Requisite", "BindsTo", "PartOf",
             "Conflicts", "ConditionPathExists", "AssertPathExists", "DefaultDependencies"},
    "Service": {"LimitNOFILE", "LimitMEMLOCK", "LimitCORE", "StandardOutput", "StandardError",
                "StandardInput", "SyslogIdentifier", "Nice", "UMask", "PrivateTmp", "NoNewPrivileges",
                "StateDirectory", "CacheDirectory", "LogsDirectory", "RuntimeDirectory", "WatchdogSec",
                "OOMScoreAdjust", "OOMPolicy", "ProtectSystem", "ProtectHome", "TasksMax", "Slice",
                "SupplementaryGroups", "ExecStop", "ExecStopPost", "ExecReload", "PIDFile",
                "CPUAffinity", "MemoryMax", "TimeoutAbortSec", "RuntimeMaxSec"},
    "Install": {"Alias", "Also", "DefaultInstance"},
}
LIST_KEYS = {"ExecStart", "ExecStartPre", "ExecStartPost", "Environment", "EnvironmentFile",
             "WantedBy", "RequiredBy", "RestartPreventExitStatus", "SuccessExitStatus"}
TYPES = ("simple", "exec", "notify", "oneshot", "forking", "idle", "dbus")
RESTARTS = ("no", "on-success", "on-failure", "on-abnormal", "on-watchdog", "on-abort", "always")
SEARCH_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def unit_name(arg: str) -> str:
    """`ddt` -> `ddt.service`, as systemctl's unit name mangling does for names without a suffix."""
    return arg if "." in arg.rsplit("@", 1)[-1] else f"{arg}.service"


def fragment_for(paths: Paths, name: str) -> Path | None:
    p = paths.unit_dir / name
    if p.is_file():
        return p
    if "@" in name:
        tpl = paths.unit_dir / (name.split("@", 1)[0] + "@." + name.rsplit(".", 1)[-1])
        if tpl.is_file():
            return tpl
    return None


def fingerprint(paths: Paths, name: str) -> list:
    """What daemon-reload compares: fragment and drop-in paths with mtime and size."""
    from hashlib import sha1   # here, not at the top: most calls of the emulator never hash

    out = []
    frag = fragment_for(paths, name)
    dropdir = paths.unit_dir / f"{name}.d"
    files = ([frag] if frag else []) + (sorted(dropdir.glob("*.conf")) if dropdir.is_dir() else [])
    for f in files:
        st = f.stat()
        out.append([str(f), st.st_mtime_ns, st.st_size, sha1(f.read_bytes()).hexdigest()])
    return out


def parse_lines(text: str, fname: str) -> list[tuple[str, str, str, int]]:
    """(section, key, value, line) assignments; raises SyntaxErr for assignments outside sections."""
    out, section, pending, start = [], None, None, 0
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if pending is not None and line[:1] in ("#", ";"):
            continue                                    # comments inside a continuation are skipped
        if pending is None:
            if not line or line[0] in "#;":
                continue
            start = no
        if line.endswith("\\"):
            pending = (pending + " " if pending is not None else "") + line[:-1]
            continue
        if pending is not None:
            line, pending = pending + " " + line, None
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise SyntaxErr(f"{fname}:{start}: Missing '=', ignoring line.")
        if section is None:
            raise SyntaxErr(f"{fname}:{start}: Assignment outside of section.")
        out.append((section, key.strip(), value.strip(), start))
    return out


def parse_command_line(value: str) -> list[dict]:
    """One Exec*= line -> commands (`;` separated), with the `-@:+!` prefixes of systemd.service(5)."""
    words = ["\x00;" if w == ";" else w for w in extract_words(value)]
    cmds, cur = [], []
    for w in words + ["\x00;"]:
        if w == "\x00;":
            if cur:
                cmds.append(cur)
            cur = []
        else:
            cur.append(";" if w == "\\;" else w)
    out = []
    for argv in cmds:
        first, flags = argv[0], ""
        while first[:1] in ("-", "@", ":", "+", "!"):
            flags, first = flags + first[0], first[1:]
        rest = argv[1:]
        if "@" in flags:
            if not rest:
                raise SyntaxErr("'@' prefix without argv[0]")
            arg0, rest = rest[0], rest[1:]
        else:
            arg0 = first
        if not first.startswith("/"):
            if "/" in first or not first:
                raise SyntaxErr(f"Neither a valid executable name nor an absolute path: {first}")
            found = [d + "/" + first for d in SEARCH_PATH if os.access(d + "/" + first, os.X_OK)]
            first = found[0] if found else first
        out.append({"path": first, "argv": [arg0, *rest], "ignore_failure": "-" in flags,
                    "no_env": ":" in flags})
    return out


def load(paths: Paths, name: str) -> dict:
    """Parse /etc/systemd/system/<name> and drop-ins into a unit dict (LoadState included)."""
    u = {"id": name, "fragment": "", "dropins": [], "load_state": "not-found", "load_error": None,
         "warnings": [], "description": name, "start_limit_interval": 10.0, "start_limit_burst": 5,
         "type": "simple", "exec_start": [], "exec_start_pre": [], "exec_start_post": [],
         "environment": {}, "environment_files": [], "working_directory": None, "user": None,
         "group": None, "restart": "no", "restart_sec": 0.1, "timeout_start": 90.0, "timeout_stop": 90.0,
         "kill_mode": "control-group", "kill_signal": int(signal.SIGTERM), "send_sigkill": True,
         "notify_access": None, "restart_prevent": [], "success_status": [], "remain_after_exit": False,
         "wanted_by": [], "required_by": [], "has_install": False, "fingerprint": fingerprint(paths, name)}
    frag = fragment_for(paths, name)
    if frag is None:
        return u
    u["fragment"] = str(frag)
    dropdir = paths.unit_dir / f"{name}.d"
    files = [frag] + (sorted(dropdir.glob("*.conf")) if dropdir.is_dir() else [])
    u["dropins"] = [str(f) for f in files[1:]]
    assignments = []
    try:
        for f in files:
            assignments += [(s, k, v, f"{f}:{n}") for s, k, v, n in parse_lines(f.read_text(), str(f))]
    except (SyntaxErr, OSError, UnicodeDecodeError) as exc:
        u.update(load_state="bad-setting", load_error=str(exc))
        return u
    user = next((v for s, k, v, _ in reversed(assignments) if (s, k) == ("Service", "User") and v), None)
    spec = specifiers(name, user)
    for section, key, value, where in assignments:
        try:
            _apply(u, section, key, value, spec)
        except (SyntaxErr, ValueError) as exc:
            if key in ("ExecStart", "ExecStartPre", "ExecStartPost"):
                u.update(load_state="bad-setting", load_error=f"{where}: {exc}")
                return u
            u["warnings"].append(f"{where}: {exc}, ignoring.")
    u["load_state"] = "loaded"
    if u["notify_access"] is None:
        u["notify_access"] = "main" if u["type"] == "notify" else "none"
    if not u["exec_start"]:
        u.update(load_state="bad-setting",
                 load_error=f"{name}: Service has no ExecStart=, ExecStop=, or SuccessAction=. Refusing.")
    elif len(u["exec_start"]) > 1 and u["type"] != "oneshot":
        u.update(load_state="bad-setting", load_error=f"{name}: Service has more than one ExecStart= "
                 "setting, which is only allowed for Type=oneshot services. Refusing.")
    return u


def _apply(u: dict, section: str, key: str, value: str, spec: dict) -> int:
    if key in LIST_KEYS and value == "":
        reset = {"ExecStart": "exec_start", "ExecStartPre": "exec_start_pre",
                 "ExecStartPost": "exec_start_post", "EnvironmentFile": "environment_files",
                 "WantedBy": "wanted_by", "RequiredBy": "required_by",
                 "RestartPreventExitStatus": "restart_prevent", "SuccessExitStatus": "success_status"}
        if key == "Environment":
            u["environment"] = {}
        else:
            u[reset[key]] = []
        return 0
    if section == "Unit":
        if key == "Description":
            u["description"] = resolve_specifiers(value, spec)
        elif key in ("StartLimitIntervalSec", "StartLimitInterval"):
            u["start_limit_interval"] = parse_timespan(value)
        elif key == "StartLimitBurst":
            u["start_limit_burst"] = int(value)
        elif key not in IGNORED_KEYS["Unit"]:
            raise SyntaxErr(f"Unknown key name '{key}' in section 'Unit'")
    elif section == "Install":
        if key in ("WantedBy", "RequiredBy"):
            u["wanted_by" if key == "WantedBy" else "required_by"] += value.split()
            u["has_install"] = True
        elif key in IGNORED_KEYS["Install"]:
            u["has_install"] = True
        else:
            raise SyntaxErr(f"Unknown key name '{key}' in section 'Install'")
    elif section == "Service":
        return _apply_service(u, key, value, spec)
    else:
        raise SyntaxErr(f"Unknown section '{section}'")
    return 0


def _apply_service(u: dict, key: str, value: str, spec: dict) -> int:
    if key in ("ExecStart", "ExecStartPre", "ExecStartPost"):
        cmds = parse_command_line(resolve_specifiers(value, spec))
        u[{"ExecStart": "exec_start", "ExecStartPre": "exec_start_pre",
           "ExecStartPost": "exec_start_post"}[key]] += cmds
        return len(cmds) if key == "ExecStart" else 0
    if key == "Environment":
        for word in extract_words(resolve_specifiers(value, spec)):
            k, sep, v = word.partition("=")
            if not sep or not k or not k.replace("_", "a").isalnum() or k[0].isdigit():
                raise SyntaxErr(f"Invalid environment assignment '{word}'")
            u["environment"][k] = v
    elif key == "EnvironmentFile":
        path = resolve_specifiers(value, spec)
        u["environment_files"].append([path.lstrip("-"), path.startswith("-")])
    elif key == "WorkingDirectory":
        path = resolve_specifiers(value, spec)
        optional = path.startswith("-")
        path = path.lstrip("-")
        u["working_directory"] = [spec["h"] if path == "~" else path, optional]
    elif key in ("User", "Group"):
        u[key.lower()] = resolve_specifiers(value, spec) or None
    elif key == "Type":
        if value not in TYPES:
            raise SyntaxErr(f"Failed to parse service type '{value}'")
        u["type"] = value
    elif key == "Restart":
        if value not in RESTARTS:
            raise SyntaxErr(f"Failed to parse service restart specifier '{value}'")
        u["restart"] = value
    elif key == "RestartSec":
        u["restart_sec"] = parse_timespan(value)
    elif key in ("TimeoutStartSec", "TimeoutStopSec", "TimeoutSec"):
        sec = parse_timespan(value) or float("inf")    # 0 disables the timeout
        if key != "TimeoutStopSec":
            u["timeout_start"] = sec
        if key != "TimeoutStartSec":
            u["timeout_stop"] = sec
    elif key == "KillMode":
        u["kill_mode"] = value
    elif key == "KillSignal":
        name = value if value.startswith("SIG") else "SIG" + value
        u["kill_signal"] = int(getattr(signal, name)) if hasattr(signal, name) else int(value)
    elif key == "SendSIGKILL":
        u["send_sigkill"] = parse_bool(value)
    elif key == "RemainAfterExit":
        u["remain_after_exit"] = parse_bool(value)
    elif key == "NotifyAccess":
        u["notify_access"] = value
    elif key in ("RestartPreventExitStatus", "SuccessExitStatus"):
        field = "restart_prevent" if key == "RestartPreventExitStatus" else "success_status"
        u[field] += [int(w) for w in value.split() if w.isdigit()]
    elif key in ("StartLimitIntervalSec", "StartLimitInterval", "StartLimitBurst"):
        return _apply(u, "Unit", key, value, spec)     # deprecated [Service] placement still accepted
    elif key not in IGNORED_KEYS["Service"]:
        raise SyntaxErr(f"Unknown key name '{key}' in section 'Service'")
    return 0
