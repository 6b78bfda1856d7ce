"""The cause of a failed start, from the service log (pure): shown first, then only that start's lines.

A failed restart used to print the last 50 journal lines, most of them from earlier runs, with
the cause somewhere in the middle. `last_start(text)` keeps the lines of the most recent start that says something (after
systemd's `Starting UNIT...` line, or the local supervisor's `--- ddtctl start` line);
`cause(lines)` picks the line that says why: the last exception line of a Python traceback
(`SomeError: message`), else the last line that is not systemd's own bookkeeping
(`Main process exited`, `Failed with result`, ...). `explain(text)` joins both for an error
message.
"""

from __future__ import annotations

import re

_START = re.compile(r"^(Starting .*\.\.\.|--- ddtctl start .*)$")
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$")
_SYSTEMD = ("Main process exited", "Failed with result", "Failed to start", "Stopped ", "Scheduled restart job",
            "Start request repeated too quickly", "Consumed ", "Deactivated successfully", "Started ",
            "Starting ", "--- ddtctl start", "Traceback (most recent call last)")


def starts(text: str) -> list[list[str]]:
    """The log split at each start line, most recent start first (one part when there is none)."""
    lines = text.rstrip("\n").splitlines()
    cuts = [i for i, line in enumerate(lines) if _START.match(line.strip())] or [0]
    return [lines[a:b] for a, b in zip(cuts[::-1], [len(lines), *cuts[::-1][:-1]], strict=True)]


def last_start(text: str) -> list[str]:
    """The lines of the most recent start that say why it failed (`cause`); systemd's automatic
    restart may have begun another start that has printed nothing yet: then the one before it.
    The most recent start's lines when none says anything."""
    parts = starts(text)
    return next((part for part in parts[:3] if cause(part)), parts[0])


def _bookkeeping(line: str) -> bool:
    text = line.strip()
    return any(text.startswith(p) or f": {p}" in text for p in _SYSTEMD)


def cause(lines: list[str]) -> str:
    """The line that says why the start failed ("" when the lines say nothing)."""
    for line in reversed(lines):
        if _EXCEPTION.match(line.strip()):
            return line.strip()
    for line in reversed(lines):
        if line.strip() and not _bookkeeping(line) and not line.startswith((" ", "\t")):
            return line.strip()
    return ""


def explain(text: str, limit: int = 30) -> str:
    """`cause: ...` then the last `limit` lines of the most recent start (for error messages)."""
    lines = last_start(text)
    why = cause(lines)
    shown = lines[-limit:]
    head = f"cause: {why}\n" if why else ""
    more = f" (last {limit} of {len(lines)})" if len(lines) > limit else ""
    return f"{head}service log of the last start{more}:\n" + "\n".join(shown)
