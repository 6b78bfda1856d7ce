"""How a line reaches the terminal, below every other ddtctl module: stdout / stderr that survive a
broken pipe, and the one-line notices (``info``) that the transport layer (remote/) may print too
(new host keys). report.py builds its tables and JSON on top of this.

Broken pipes (`ddtctl deploy local 2>&1 | tee log` after `tee` died, `ddtctl status | head -1`):
inside :func:`pipe_safe` (every command runs in it) a write or flush that fails with EPIPE never
raises: the stream's file descriptor is pointed at /dev/null (what Python's documentation
recommends for SIGPIPE), ddtctl keeps working (rollbacks, lock releases) and only its output is
lost; :func:`output_lost` tells the CLI to exit non-zero (cli/_common.py).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from rich.console import Console

_PIPE_ERRORS = (BrokenPipeError, ConnectionResetError)
_lost: set[str] = set()


def output_broken(stream) -> None:
    """`stream`'s reader has gone: send the rest of its output to /dev/null (never raises)."""
    with suppress(Exception):
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
        _lost.add(f"fd {fd}")
        return
    _lost.add(repr(stream))


def output_lost() -> bool:
    """True when some output could not be written (a broken pipe) during this command."""
    return bool(_lost)


class _Safe:
    """A stdout/stderr (text or binary) whose writes never raise for a broken pipe."""

    def __init__(self, inner):
        self._inner = inner

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except _PIPE_ERRORS:
            output_broken(self._inner)
            with suppress(Exception):
                self._inner.flush()           # the pending bytes now go to /dev/null
            return len(args[0]) if args else None

    def write(self, data):
        return self._guard(self._inner.write, data)

    def flush(self):
        return self._guard(self._inner.flush)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    @property
    def buffer(self):
        return _Safe(self._inner.buffer)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@contextmanager
def pipe_safe() -> Iterator[None]:
    """sys.stdout/sys.stderr wrapped so that a broken pipe never raises (see module docstring)."""
    _lost.clear()
    saved = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, _Safe):
        sys.stdout = _Safe(sys.stdout)
    if not isinstance(sys.stderr, _Safe):
        sys.stderr = _Safe(sys.stderr)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = saved


def err_console() -> Console:
    """A console on stderr (created per call so tests capturing stderr see the output)."""
    from rich.console import Console     # rich is imported by the first line printed, not by `--help`

    width = None if sys.stderr.isatty() else 160     # logs and pipes: do not squeeze tables to 80 columns
    return Console(file=sys.stderr, highlight=False, soft_wrap=True, width=width)


def info(message: str) -> None:
    from rich.markup import escape

    err_console().print(escape(message))
