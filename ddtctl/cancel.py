"""Cooperative cancellation of per-host work after Ctrl-C.

Host work runs in worker threads (`cli/_common.per_host`); Python delivers SIGINT to the main
thread only. The first Ctrl-C sets the event below; deploys and readiness waits call `check()` at
step boundaries and between polls, raise `Interrupted` (exit 130), and unwind the normal way: a
deploy rolls back what it changed and releases its host lock. A second Ctrl-C aborts at once
(a host lock may then be left: `--break-lock`).
"""

from __future__ import annotations

import threading

from ddtctl.errors import DdtctlError, ExitCode

_requested = threading.Event()


class Interrupted(DdtctlError):
    """The operator pressed Ctrl-C; the host stopped at a step boundary (exit 130)."""

    exit_code = ExitCode.INTERRUPTED


def request() -> None:
    """Ask every running host job to stop at its next step boundary."""
    _requested.set()


def reset() -> None:
    """Forget an earlier request (a new command starts)."""
    _requested.clear()


def requested() -> bool:
    return _requested.is_set()


def check(where: str = "") -> None:
    """Raise Interrupted if Ctrl-C was pressed; `where` names the step for the message."""
    if _requested.is_set():
        raise Interrupted(f"interrupted{f' before {where}' if where else ''} (Ctrl-C)")
