"""Local child processes for LocalTransport: each in its own session, stopped by process group.

* :func:`collect`: run to completion collecting stdout/stderr (``LocalTransport.run``), checking
  every POLL s for the deadline (SIGKILL to the group -> CommandTimeout) and, for a command that
  was already running when Ctrl-C came, for Ctrl-C (SIGTERM, SIGKILL KILL_AFTER s later ->
  cancel.Interrupted).
* :func:`relay`: ``ddtctl exec`` on this machine: bytes relayed as they come (remote/relay.py);
  ``timeout`` as timeout(1) (SIGTERM, SIGKILL KILL_AFTER s later; 124, or 137 when it had to be
  killed); Ctrl-C passed on as SIGINT (the terminal's signal reaches ddtctl only), then
  cancel.Interrupted.
Every child group is registered with cancel.py, so a second Ctrl-C (abort) kills it too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import BinaryIO

from ddtctl import cancel
from ddtctl.errors import CommandTimeout
from ddtctl.remote import relay as relays
from ddtctl.remote.result import Result

POLL = 0.1  # s between checks for Ctrl-C and the deadline


def _signal_wait(proc: subprocess.Popen, sig: int, reap=None) -> bool:
    """Signal ``proc``'s group, give it KILL_AFTER s, then SIGKILL the group; True when SIGKILL
    was needed. ``reap(timeout)`` waits for it (default ``proc.wait``)."""
    reap = reap or proc.wait
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, sig)
    try:
        reap(relays.KILL_AFTER)
        return False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        reap(None)
        return True


def _code(proc: subprocess.Popen) -> int:
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


def collect(proc: subprocess.Popen, items: tuple[str, ...], stdin: bytes | None, timeout: float | None,
            name: str, interruptible: bool) -> Result:
    """Wait for ``proc`` (see the module docstring); returns its Result."""
    start, data, got = time.monotonic(), stdin, None
    cancel.register_child(proc.pid)
    try:
        while got is None:
            try:
                got = proc.communicate(input=data, timeout=POLL)
                break
            except subprocess.TimeoutExpired:
                data = None                            # communicate() keeps feeding what is left
            if timeout is not None and time.monotonic() - start > timeout:
                out: list = []
                _signal_wait(proc, signal.SIGKILL, lambda t, out=out: out.append(proc.communicate(timeout=t)))
                so, se = out[-1] if out else (b"", b"")
                partial = Result(items, -9, so or b"", se or b"", time.monotonic() - start, name)
                raise CommandTimeout(f"{name}: timed out after {timeout} s: {items[0]}", partial)
            if interruptible and cancel.requested():
                _signal_wait(proc, signal.SIGTERM, lambda t: proc.communicate(timeout=t))
                raise cancel.Interrupted(f"{name}: interrupted (Ctrl-C) while running {items[0]}")
    finally:
        cancel.unregister_child(proc.pid)
    return Result(items, _code(proc), got[0], got[1], time.monotonic() - start, name)


def relay(proc: subprocess.Popen, stdin: BinaryIO | None, stdout: BinaryIO, stderr: BinaryIO,
          timeout: float | None) -> int:
    """Relay ``proc`` (started with stdout/stderr pipes, stdin a pipe when ``stdin`` is given);
    returns its exit status. Raises cancel.Interrupted, relay.BrokenOutput."""
    cancel.register_child(proc.pid)
    try:
        return _relay(proc, stdin, stdout, stderr, timeout)
    finally:
        cancel.unregister_child(proc.pid)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def _relay(proc, stdin, stdout, stderr, timeout) -> int:
    if stdin is not None:
        relays.pump_stdin(relays.reader(stdin), proc.stdin.write, proc.stdin.close)
    broken: list[BaseException] = []

    def copy(src, dst) -> None:
        try:
            while data := os.read(src.fileno(), 65536):
                relays.emit(dst, data)
        except relays.BrokenOutput as exc:
            broken.append(exc)
        except OSError:
            pass
    copiers = [threading.Thread(target=copy, args=pair, daemon=True)
               for pair in ((proc.stdout, stdout), (proc.stderr, stderr))]
    for t in copiers:
        t.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out = killed = False
    while proc.poll() is None:
        if broken:
            _signal_wait(proc, signal.SIGTERM)
            raise broken[0]
        if cancel.requested():
            _signal_wait(proc, signal.SIGINT)          # what the terminal would have sent it
            raise cancel.Interrupted("interrupted (Ctrl-C)")
        if deadline is not None and time.monotonic() > deadline:
            timed_out, killed = True, _signal_wait(proc, signal.SIGTERM)
            break
        time.sleep(POLL / 2)
    for t in copiers:
        t.join()
    if broken:
        raise broken[0]
    if timed_out:
        return 137 if killed else relays.TIMED_OUT
    return _code(proc)
