"""systemd value parsers: EnvironmentFile= contents, time spans, booleans.

Emulates:
* systemd.exec(5) `EnvironmentFile=`: `KEY=value` lines, `#`/`;` comments, single and double quotes
  (a quoted value may span lines), backslash continuation, trailing blanks of unquoted values
  dropped; values are NOT specifier- or variable-expanded; invalid names are ignored with a warning
  (state machine of systemd's src/basic/env-file.c).
* systemd.time(7) time spans: `90`, `1.5s`, `30min`, `1h 30min`, `100ms`, `infinity`.
* systemd.syntax(7) booleans: 1/yes/y/true/t/on and 0/no/n/false/f/off.
"""

from __future__ import annotations

import re

from .syntax import ENV_NAME, WHITESPACE, SyntaxErr


def parse_env_file(text: str) -> tuple[dict[str, str], list[str]]:
    """Parse an EnvironmentFile= like env-file.c's state machine; returns (env, warnings)."""
    env: dict[str, str] = {}
    warnings: list[str] = []
    state, key, value, keep = "pre_key", [], [], 0    # keep: value length before trailing blanks

    def push() -> None:
        k = "".join(key).rstrip(WHITESPACE)
        v = "".join(value[:keep]) if state == "value" else "".join(value)
        if ENV_NAME.match(k):
            env[k] = v
        else:
            warnings.append(f"Invalid variable name {k!r}, ignoring.")

    for c in text + "\n":
        if state == "pre_key":
            if c in "#;":
                state = "comment"
            elif c not in WHITESPACE:
                state, key, value, keep = "key", [c], [], 0
        elif state == "key":
            if c == "\n":
                warnings.append(f"Ignoring line without '=': {''.join(key)!r}")
                state = "pre_key"
            elif c == "=":
                state = "pre_value"
            else:
                key.append(c)
        elif state == "pre_value":
            if c == "\n":
                push()
                state = "pre_key"
            elif c == "'":
                state = "squote"
            elif c == '"':
                state = "dquote"
            elif c == "\\":
                state = "value_esc"
            elif c not in WHITESPACE:
                value.append(c)
                state, keep = "value", len(value)
        elif state == "value":
            if c == "\n":
                push()
                state = "pre_key"
            elif c == "\\":
                state = "value_esc"
            else:
                value.append(c)
                if c not in WHITESPACE:
                    keep = len(value)
        elif state == "value_esc":
            if c != "\n":
                value.append(c)
            state, keep = "value", len(value)
        elif state == "squote":
            if c == "'":
                state = "pre_value"
            else:
                value.append(c)
        elif state == "dquote":
            if c == '"':
                state = "pre_value"
            elif c == "\\":
                state = "dquote_esc"
            else:
                value.append(c)
        elif state == "dquote_esc":
            if c in '"\\`$':
                value.append(c)
            elif c != "\n":
                value.extend(("\\", c))
            state = "dquote"
        elif state == "comment":
            if c == "\\":
                state = "comment_esc"
            elif c == "\n":
                state = "pre_key"
        elif state == "comment_esc":
            state = "comment"
    if state in ("squote", "dquote", "dquote_esc"):
        push()
    return env, warnings


_UNITS = {
    "us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "": 1.0, "s": 1.0, "sec": 1.0,
    "second": 1.0, "seconds": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hour": 3600.0, "hours": 3600.0, "d": 86400.0, "day": 86400.0,
    "days": 86400.0, "w": 604800.0, "week": 604800.0, "weeks": 604800.0,
    "M": 2629800.0, "month": 2629800.0, "months": 2629800.0, "y": 31557600.0, "year": 31557600.0,
    "years": 31557600.0,
}


def parse_timespan(s: str) -> float:
    """systemd.time(7) span in seconds; `infinity` -> float('inf'). Raises SyntaxErr."""
    s = s.strip()
    if s == "infinity":
        return float("inf")
    parts = re.findall(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)", s)
    if not parts or "".join(n + u for n, u in parts) != re.sub(r"\s+", "", s):
        raise SyntaxErr(f"Failed to parse time span {s!r}")
    total = 0.0
    for num, unit in parts:
        if unit not in _UNITS:
            raise SyntaxErr(f"Failed to parse time span {s!r}")
        total += float(num) * _UNITS[unit]
    return total


def parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "yes", "y", "true", "t", "on"):
        return True
    if v in ("0", "no", "n", "false", "f", "off"):
        return False
    raise SyntaxErr(f"Failed to parse boolean value {s!r}")


def format_timespan(sec: float) -> str:
    """Like format_timespan() in `systemctl show` output (e.g. `1min 30s`, `100ms`, `infinity`)."""
    if sec == float("inf"):
        return "infinity"
    if sec == 0:
        return "0"
    out = []
    us = int(round(sec * 1e6))
    for name, size in (("d", 86400_000_000), ("h", 3600_000_000), ("min", 60_000_000),
                       ("s", 1_000_000), ("ms", 1000), ("us", 1)):
        if us >= size:
            out.append(f"{us // size}{name}")
            us %= size
    return " ".join(out)
