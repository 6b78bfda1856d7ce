"""systemctl emulation: command line parsing and verb dispatch (see ctl.py for the semantics).

Options as systemctl(1): `-p/--property=A,B` (repeatable), `--value`, `--no-block`, `--now`,
`-q/--quiet`, `-a/--all`, `-n/--lines=N` (status), and the accepted no-ops `--no-pager -l --full
--plain --no-legend --system --no-ask-password --wait -f/--force`. Unit names without a suffix get
`.service`. An unknown option exits 1 with systemctl's message; an unknown verb too.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from . import ratelimit, state, unitfile
from .ctl import FLAGS, JOB_VERBS, Ctl, err
from .paths import Paths

NEEDS_UNITS = set(JOB_VERBS) | {"enable", "disable", "is-active", "is-failed", "is-enabled", "show",
                                "cat", "status"}


def parse(argv: list[str]) -> tuple[str | None, list[str], set, list[str], int]:
    opts, props, lines, rest = set(), [], 10, []
    i = 0
    while i < len(argv):
        a = argv[i]
        i += 1
        if a in FLAGS:
            opts.add(a)
        elif a in ("-p", "--property", "-n", "--lines"):
            if i >= len(argv):
                raise SystemExit(f"systemctl: option '{a}' requires an argument")
            if a in ("-p", "--property"):
                props += argv[i].split(",")
            else:
                lines = int(argv[i])
            i += 1
        elif a.startswith("--property="):
            props += a.split("=", 1)[1].split(",")
        elif a.startswith("-p") and len(a) > 2 and not a.startswith("--"):
            props += a[2:].split(",")
        elif a.startswith("--lines=") or (a.startswith("-n") and a[2:].isdigit()):
            lines = int(a.split("=", 1)[1] if "=" in a else a[2:])
        elif a.startswith("-") and a != "-":
            raise SystemExit(f"systemctl: unrecognized option '{a}'" if a.startswith("--")
                             else f"systemctl: invalid option -- '{a[1:2]}'")
        else:
            rest.append(a)
    verb = rest[0] if rest else None
    return verb, [unitfile.unit_name(n) for n in rest[1:]], opts, [p for p in props if p], lines


def main(argv: list[str]) -> int:
    paths = Paths.from_env()
    try:
        verb, names, opts, props, lines = parse(argv)
    except (SystemExit, ValueError) as exc:
        err(str(exc))
        return 1
    ctl = Ctl(paths, opts, props, lines)
    if verb in NEEDS_UNITS and not names:
        err("Too few arguments.")
        return 1
    if verb in ("daemon-reload", "daemon-reexec"):
        return ctl.daemon_reload()
    if verb == "is-system-running":
        if not {"-q", "--quiet"} & opts:
            print("running")
        return 0
    if verb in JOB_VERBS:
        rc = 0
        for name in names:
            rc = ctl.job(verb, name) or rc
        return rc
    if verb in ("enable", "disable"):
        rc = 0
        for name in names:
            rc = ctl.enable(name, verb == "enable") or rc
        return rc
    if verb in ("is-active", "is-failed", "is-enabled"):
        return ctl.query(verb, names)
    if verb == "status":
        return ctl.status(names)
    if verb == "show":
        return ctl.show(names)
    if verb == "cat":
        return cat(paths, names)
    if verb == "reset-failed":
        return reset_failed(ctl, names or state.known_units(paths))
    if verb is None:
        err("systemctl emulation: list-units is not emulated; give a verb.")
        return 1
    err(f"Unknown command verb '{verb}'.")
    return 1


def cat(paths: Paths, names: list[str]) -> int:
    rc = 0
    for i, name in enumerate(names):
        frag = unitfile.fragment_for(paths, name)
        if frag is None:
            err(f"No files found for {name}.")
            rc = 1
            continue
        dropdir = paths.unit_dir / f"{name}.d"
        files = [frag] + (sorted(dropdir.glob("*.conf")) if dropdir.is_dir() else [])
        for j, f in enumerate(files):
            sep = "\n" if (i or j) else ""
            sys.stdout.write(f"{sep}# /{f.relative_to(paths.root)}\n{f.read_text()}")
    return rc


def reset_failed(ctl: Ctl, names: list[str]) -> int:
    """systemctl(1) reset-failed as systemd 252's unit_reset_failed() + service_reset_failed():
    failed -> inactive, Result=success, NRestarts=0, and the start rate limit forgotten (also
    for a running unit, whose supervisor applies the NRestarts/Result part on SIGUSR1). A unit
    that is not loaded: "Failed to reset failed state of unit X: Unit X not loaded.", the other
    names are still reset, exit 1 (verb_reset_failed() returns the bus error)."""
    rc = 0
    for name in names:
        with state.locked(ctl.p, name):
            u = ctl.unit(name, warn=False)
            if u["load_state"] == "not-found" and not ctl.p.state_file(name).exists():
                err(f"Failed to reset failed state of unit {name}: Unit {name} not loaded.")
                rc = 1
                continue
            ratelimit.reset(ctl.p, name)
            st = state.effective(state.read(ctl.p, name))
            if state.supervisor_alive(st):
                os.kill(st["supervisor"][0], signal.SIGUSR1)
                deadline = time.monotonic() + 2
                while state.read(ctl.p, name)["NRestarts"] and time.monotonic() < deadline:
                    time.sleep(0.02)
                continue
            if st["ActiveState"] == "failed":
                state.set_state(st, "inactive", "dead")
                st.update(supervisor=None)
            st.update(Result="success", NRestarts=0)
            state.write(ctl.p, name, st)
    return rc
