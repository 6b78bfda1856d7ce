"""Byte relays for ``ddtctl exec``: a remote command's stdin/stdout/stderr as a real pipe.

* Bytes pass unchanged (never decoded); each chunk is written and flushed as it arrives, so
  ``exec HOST -- journalctl -f`` shows lines as they come.
* stdin is forwarded as it is read (``os.read`` on its file descriptor, or ``read1`` for an
  in-memory stream) and its EOF closes the command's stdin (SSH ``shutdown_write`` / pipe close).
* A write to a closed stdout (``| head``) stops the relay (the caller exits as for a broken pipe).
* Ctrl-C (cancel.requested()) ends the relay with cancel.Interrupted; ``deadline`` (monotonic
  seconds, a client-side backstop to ``timeout(1)`` on the far side) returns 124.
"""

from __future__ import annotations

import io
import os
import select
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO

from ddtctl import cancel
from ddtctl.output import output_broken, output_lost

if TYPE_CHECKING:       # local commands (exec on a local host) relay without paramiko
    import paramiko

LOST = "lost"            # relay_channel's answer when the SSH connection died
TIMED_OUT = 124          # timeout(1)'s exit status
KILL_AFTER = 5.0         # s between SIGTERM and SIGKILL (timeout -k)
BACKSTOP = 10.0          # s the client waits beyond timeout + KILL_AFTER for the far side
NO_STATUS = 255          # exit status when the server reported none (as ssh(1))


class BrokenOutput(Exception):
    """The local stdout/stderr reader went away (EPIPE)."""


def client_deadline(timeout: float | None) -> float | None:
    """Monotonic time after which the client gives up on a command run with ``timeout``."""
    return None if timeout is None else time.monotonic() + timeout + KILL_AFTER + BACKSTOP


def reader(stream: BinaryIO | None) -> Callable[[], bytes] | None:
    """A function returning the next available stdin bytes (b"" at EOF), or None for no stdin."""
    if stream is None:
        return None
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        read1 = getattr(stream, "read1", None) or stream.read
        return lambda: read1(65536)
    return lambda: os.read(fd, 65536)


def emit(stream: BinaryIO, data: bytes) -> None:
    """Write and flush; raises BrokenOutput when the reader has gone (also when the write was
    swallowed by output.pipe_safe)."""
    try:
        stream.write(data)
        stream.flush()
    except (BrokenPipeError, ConnectionResetError) as exc:
        output_broken(stream)
        raise BrokenOutput(str(exc)) from None
    if output_lost():
        raise BrokenOutput("output pipe closed")


def pump_stdin(read: Callable[[], bytes] | None, send: Callable[[bytes], None],
               close: Callable[[], None], errors: tuple[type[Exception], ...] = ()) -> threading.Thread:
    """Forward stdin in a daemon thread until EOF (then ``close()``) or a send error (OSError,
    EOFError, and the transport's own `errors`, e.g. paramiko.SSHException)."""
    def run() -> None:
        try:
            while read is not None:
                data = read()
                if not data:
                    break
                send(data)
        except (OSError, EOFError, ValueError, *errors):
            pass
        try:
            close()
        except (OSError, EOFError, *errors):
            pass
    thread = threading.Thread(target=run, name="stdin", daemon=True)
    thread.start()
    return thread


def relay_channel(chan: paramiko.Channel, transport: paramiko.Transport, stdin: BinaryIO | None,
                  stdout: BinaryIO, stderr: BinaryIO, deadline: float | None) -> int | str:
    """Relay an exec'd SSH channel; returns its exit status (255 when none was sent), 124 past
    ``deadline``, or LOST when the connection died. Raises cancel.Interrupted, BrokenOutput."""
    import paramiko          # loaded already: the channel is paramiko's

    pump_stdin(reader(stdin), chan.sendall, chan.shutdown_write, errors=(paramiko.SSHException,))
    while True:
        if cancel.requested():
            chan.close()
            raise cancel.Interrupted("interrupted (Ctrl-C); the remote command's session was closed")
        if deadline is not None and time.monotonic() > deadline:
            chan.close()
            return TIMED_OUT
        select.select([chan], [], [], 0.2)
        moved = False
        while chan.recv_ready():
            emit(stdout, chan.recv(65536))
            moved = True
        while chan.recv_stderr_ready():
            emit(stderr, chan.recv_stderr(65536))
            moved = True
        if moved:
            continue
        if chan.exit_status_ready() and (chan.eof_received or chan.closed):
            code = chan.recv_exit_status()
            if code < 0 and not transport.is_active():
                return LOST
            return NO_STATUS if code < 0 else code
        if not transport.is_active():
            return LOST
        if chan.closed:      # closed after the status check above: the next round reads its status
            continue
