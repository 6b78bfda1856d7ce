"""journalctl emulation over the per-unit journals that the systemctl emulation writes.

Emulates journalctl(1) for what ddtctl and humans use: `-u/--unit UNIT` (repeatable, globs, a
missing `.service` suffix is added), `-n/--lines [N]` (bare `-n` = 10), `-e` (= `-n 1000`),
`-o/--output short|short-iso|short-precise|cat|json`, `-r`, `-g/--grep`, `--since/--until`
(`YYYY-MM-DD [HH:MM[:SS]]`, `HH:MM[:SS]`, `today`, `yesterday`, `now`, `@EPOCH`, `-5min`, `5min ago`),
`-q`, and the accepted no-ops `--no-pager -b -x --no-hostname --utc --system`. Default output is
`Mon DD HH:MM:SS host ident[pid]: message`; `-o cat` prints the message only. An empty result
prints `-- No entries --` (unless `-q`) and exits 0. `-f/--follow` is not emulated (exit 1).
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
import time

from .paths import Paths
from .unitfile import unit_name
from .values import parse_timespan

NOOP_FLAGS = {"--no-pager", "-b", "--boot", "-x", "--catalog", "--no-hostname", "--utc", "--system",
              "-a", "--all", "--no-full", "-l", "--full", "-m", "--merge"}
VALUE_OPTS = {"-u": "unit", "--unit": "unit", "-n": "lines", "--lines": "lines", "-o": "output",
              "--output": "output", "-g": "grep", "--grep": "grep", "-S": "since", "--since": "since",
              "-U": "until", "--until": "until"}
OUTPUTS = ("short", "short-iso", "short-precise", "short-full", "cat", "json", "verbose")


class Usage(Exception):
    pass


def parse_time(s: str, now: float) -> float:
    s = s.strip()
    day = time.mktime(time.localtime(now)[:3] + (0, 0, 0, 0, 0, -1))
    fixed = {"now": now, "today": day, "yesterday": day - 86400, "tomorrow": day + 86400}
    if s in fixed:
        return fixed[s]
    if s.startswith("@"):
        return float(s[1:])
    m = re.fullmatch(r"([+-])\s*(.+)|(.+?)\s+ago|(.+?)\s+left", s)
    if m:
        try:
            sign, amount = (m.group(1), m.group(2)) if m.group(1) else ("-" if m.group(3) else "+",
                                                                        m.group(3) or m.group(4))
            return now + (-1 if sign == "-" else 1) * parse_timespan(amount)
        except ValueError:
            pass
    for fmt in ("%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d"):
        try:
            return time.mktime(time.strptime(s, fmt))
        except ValueError:
            pass
    for fmt in ("%H:%M:%S", "%H:%M"):
        try:
            t = time.strptime(s, fmt)
            return day + t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec
        except ValueError:
            pass
    raise Usage(f"Failed to parse timestamp: {s}")


def read_records(paths: Paths, units: list[str]) -> list[dict]:
    files = sorted(paths.journal_dir.glob("*.jsonl")) if paths.journal_dir.is_dir() else []
    if units:
        pats = [unit_name(u) for u in units]
        files = [f for f in files if any(fnmatch.fnmatchcase(f.name[:-6], p) for p in pats)]
    recs = []
    for f in files:
        for line in f.read_text(errors="replace").splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
    recs.sort(key=lambda r: r["ts"])
    return recs


def format_record(r: dict, output: str) -> str:
    if output == "cat":
        return r["msg"]
    if output == "json":
        return json.dumps({"__REALTIME_TIMESTAMP": str(int(r["ts"] * 1e6)), "_HOSTNAME": r["host"],
                           "SYSLOG_IDENTIFIER": r["ident"], "_PID": str(r["pid"]), "MESSAGE": r["msg"],
                           ("UNIT" if r["ident"] == "systemd" else "_SYSTEMD_UNIT"): r["unit"]})
    lt = time.localtime(r["ts"])
    if output == "short-iso":
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z", lt)
    elif output == "short-precise":
        stamp = time.strftime("%b %d %H:%M:%S", lt) + f".{int(r['ts'] % 1 * 1e6):06d}"
    elif output == "short-full":
        stamp = time.strftime("%a %Y-%m-%d %H:%M:%S %Z", lt)
    else:
        stamp = time.strftime("%b %d %H:%M:%S", lt)
    return f"{stamp} {r['host']} {r['ident']}[{r['pid']}]: {r['msg']}"


def unit_tail(paths: Paths, unit: str, n: int) -> list[str]:
    """The last n lines in default format (for `systemctl status`)."""
    return [format_record(r, "short") for r in read_records(paths, [unit])[-n:]]


SHORT_FLAGS = {"q": "quiet", "r": "reverse", "e": "end", "f": "follow", "b": None, "x": None, "a": None,
               "l": None, "m": None}


def _set(opts: dict, name: str, value: str) -> None:
    if name == "unit":
        opts["unit"].append(value)
    elif name == "lines":
        if not value.lstrip("+").isdigit():
            raise Usage(f"Failed to parse lines '{value}'")
        opts["lines"] = int(value.lstrip("+"))
    elif name == "output" and value not in OUTPUTS:
        raise Usage(f"Unknown output format '{value}'.")
    else:
        opts[name] = value


def _flag(opts: dict, name: str | None) -> None:
    if name == "follow":
        raise Usage("journalctl emulation: --follow is not supported")
    if name == "end":
        opts["lines"] = opts["lines"] or 1000
    elif name:
        opts[name] = True


def _take_value(opts: dict, name: str, value: str | None, argv: list[str], i: int, missing: str) -> int:
    """Set option `name` from its attached `value` or the next word argv[i]; returns the new i.
    A bare `-n`/`--lines` not followed by a number means 10 lines (journalctl(1))."""
    if value is None:
        if name == "lines" and (i >= len(argv) or not argv[i].lstrip("+").isdigit()):
            opts["lines"] = 10
            return i
        if i >= len(argv):
            raise Usage(missing)
        value, i = argv[i], i + 1
    _set(opts, name, value)
    return i


def parse_args(argv: list[str]) -> dict:
    """getopt-style: `-xeu UNIT`, `-n50`, `-n 50`, bare `-n`, `--unit=U`, `--unit U`."""
    opts = {"unit": [], "lines": None, "output": "short", "grep": None, "since": None, "until": None,
            "quiet": False, "reverse": False}
    i = 0
    while i < len(argv):
        a = argv[i]
        i += 1
        if a.startswith("--"):
            key, eq, value = a.partition("=")
            if key in NOOP_FLAGS:
                continue
            if key in ("--quiet", "--reverse", "--pager-end", "--follow"):
                _flag(opts, {"--pager-end": "end"}.get(key, key[2:]))
                continue
            if key not in VALUE_OPTS:
                raise Usage(f"journalctl: unrecognized option '{a}'")
            i = _take_value(opts, VALUE_OPTS[key], value if eq else None, argv, i,
                            f"journalctl: option '{key}' requires an argument")
            continue
        if not a.startswith("-") or a == "-":
            raise Usage(f"journalctl emulation: match expressions are not supported: {a}")
        j = 1
        while j < len(a):
            c = a[j]
            j += 1
            if c in SHORT_FLAGS:
                _flag(opts, SHORT_FLAGS[c])
                continue
            if "-" + c not in VALUE_OPTS:
                raise Usage(f"journalctl: invalid option -- '{c}'")
            i = _take_value(opts, VALUE_OPTS["-" + c], a[j:] or None, argv, i,
                            f"journalctl: option requires an argument -- '{c}'")
            break
    return opts


def main(argv: list[str]) -> int:
    paths = Paths.from_env()
    try:
        o = parse_args(argv)
        now = time.time()
        since = parse_time(o["since"], now) if o["since"] else None
        until = parse_time(o["until"], now) if o["until"] else None
    except Usage as exc:
        print(exc, file=sys.stderr)
        return 1
    recs = read_records(paths, o["unit"])
    recs = [r for r in recs if (since is None or r["ts"] >= since) and (until is None or r["ts"] <= until)
            and (o["grep"] is None or re.search(o["grep"], r["msg"]))]
    if o["lines"] is not None:
        recs = recs[-o["lines"]:] if o["lines"] else []
    if o["reverse"]:
        recs.reverse()
    if not recs:
        if not o["quiet"]:
            print("-- No entries --")
        return 0
    out = "".join(format_record(r, "short" if o["output"] == "verbose" else o["output"]) + "\n" for r in recs)
    sys.stdout.write(out)
    return 0
