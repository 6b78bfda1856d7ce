"""Ctrl-C: cooperative cancellation of host work, the same in every command.

:func:`sigint_handler` (installed by every CLI command) turns the FIRST Ctrl-C into a request:
host work (worker threads of `cli/_common.per_host`, or the main thread) stops at its next step
boundary, readiness poll or smoke check (`check()` raises :class:`Interrupted`, exit 130), and a
local command in flight is stopped (remote/transport.py). Everything then unwinds the normal way:
a deploy rolls back what it changed and releases its host lock, results are still reported, and
the process exits 130. Commands started AFTER the request (rollback, clean-up, lock release) and
code under :func:`shielded` are not interrupted. No KeyboardInterrupt is raised, so no write or
clean-up is cut in half.

A SECOND Ctrl-C aborts at once: local child process groups are killed and the process exits 130
without unwinding (a host lock may then stay behind; the next ddtctl run on this machine takes it
over as stale, see ops/lock.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from ddtctl.errors import DdtctlError, ExitCode

_requested = threading.Event()
_local = threading.local()
_children: set[int] = set()
_children_lock = threading.Lock()
FIRST_NOTICE = (b"\ninterrupted: stopping each host at its next step; rollbacks and lock releases "
                b"still run (Ctrl-C again to abort at once)\n")
ABORT_NOTICE = b"\naborted (second Ctrl-C): host locks may be left behind\n"


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
    """True after Ctrl-C, except in this thread's :func:`shielded` sections."""
    return _requested.is_set() and not getattr(_local, "shield", 0)


def was_requested() -> bool:
    """True after Ctrl-C, shield or not (for the exit code)."""
    return _requested.is_set()


def check(where: str = "") -> None:
    """Raise Interrupted if Ctrl-C was pressed; `where` names the step for the message."""
    if requested():
        raise Interrupted(f"interrupted{f' before {where}' if where else ''} (Ctrl-C)")


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """In this thread, Ctrl-C does not interrupt the block (rollback, clean-up, lock release)."""
    _local.shield = getattr(_local, "shield", 0) + 1
    try:
        yield
    finally:
        _local.shield -= 1


def register_child(pgid: int) -> None:
    """A local child process group to kill on an abort (second Ctrl-C)."""
    with _children_lock:
        _children.add(pgid)


def unregister_child(pgid: int) -> None:
    with _children_lock:
        _children.discard(pgid)


def _write(data: bytes) -> None:
    try:
        os.write(2, data)           # unbuffered: safe inside a signal handler, EPIPE ignored
    except OSError:
        pass


def _on_sigint(_signum, _frame) -> None:
    if not _requested.is_set():
        _requested.set()
        _write(FIRST_NOTICE)
        return
    _write(ABORT_NOTICE)
    if os.isatty(2):
        _write(b"\x1b[?25h")           # a progress display hid the cursor: show it again
    with _children_lock:
        groups = list(_children)
    for pgid in groups:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    os._exit(int(ExitCode.INTERRUPTED))


@contextlib.contextmanager
def sigint_handler() -> Iterator[None]:
    """Install the two-stage Ctrl-C handling for one command (main thread only; elsewhere, and
    when SIGINT is ignored, nothing changes). Clears an earlier request first."""
    reset()
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
