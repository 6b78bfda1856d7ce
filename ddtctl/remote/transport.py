"""The Transport protocol (docs/architecture.md "Transport contract") and LocalTransport.

Implementations: :class:`LocalTransport` (this machine), ``ssh.SshTransport`` (a node over SSH),
``pct.ContainerTransport`` (an LXC container through ``pct exec`` on a node transport).

Commands are argv lists everywhere; a transport serialises them at most once per shell that parses
them (docs/operations.md §2, §13.1). Concrete transports also accept ``idempotent=True`` on ``run``
(safe to retry after a connection drop); it is not part of the protocol and LocalTransport ignores
it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, ContextManager, Protocol, runtime_checkable

from ddtctl import cancel
from ddtctl.remote import localproc, relay
from ddtctl.remote.command import validate_argv
from ddtctl.remote.push import ExecFileOps, Progress, push_file
from ddtctl.remote.result import PutResult, Result


@runtime_checkable
class Transport(Protocol):
    """Where commands run and files go.

    name: "local", "node:pve1", "ct200@pve1".
    run(argv, stdin=None, timeout=None, env=None) -> Result: argv is a real argv vector; stdin bytes
        are written then closed (stdin is closed/empty when None); timeout in seconds raises
        CommandTimeout; env adds variables for this command only. A non-zero exit is NOT an error
        (call ``Result.check()``); connection failures raise UnreachableError. ``idempotent=True``
        (a read, or a write that may run twice): a connection lost while it runs is reconnected
        once and the command repeated (SshTransport; the local transport has no connection).
    put(local, remote, mode=0o644, progress=None) -> PutResult: streamed, resumable and sha256
        verified; progress(done_bytes, total_bytes). Raises TransferError / RemoteError.
    forward(host, port): context manager yielding an (address, port) on THIS machine that reaches
        host:port as seen from the transport's side.
    stream(argv, stdin=, stdout=, stderr=, timeout=None, env=None) -> int: ``ddtctl exec``: bytes
        relayed both ways as they come (remote/relay.py), the exit status returned; with timeout
        the command is stopped like timeout(1) (exit 124). Raises UnreachableError, Interrupted.
    close(): release connections; idempotent.
    """

    name: str

    def run(self, argv: Sequence[str], *, stdin: bytes | None = None,
            timeout: float | None = None, env: Mapping[str, str] | None = None,
            idempotent: bool = False) -> Result: ...

    def put(self, local: Path, remote: str, *, mode: int = 0o644,
            progress: Progress | None = None) -> PutResult: ...

    def forward(self, host: str, port: int) -> ContextManager[tuple[str, int]]: ...

    def stream(self, argv: Sequence[str], *, stdin: BinaryIO | None, stdout: BinaryIO,
               stderr: BinaryIO, timeout: float | None = None,
               env: Mapping[str, str] | None = None) -> int: ...

    def close(self) -> None: ...


class _LocalFileOps(ExecFileOps):
    """Push primitives on this machine; chunks are written with plain file I/O."""

    def write(self, path: str, offset: int, chunks: Iterable[bytes],
              sent: Callable[[int], None]) -> None:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if offset == 0 else 0)
        fd = os.open(path, flags, 0o600)
        with os.fdopen(fd, "r+b" if offset else "wb") as fh:
            fh.seek(offset)
            for chunk in chunks:
                fh.write(chunk)
                fh.flush()
                sent(len(chunk))


class LocalTransport:
    """Runs argv with ``subprocess`` on this machine (never ``shell=True``).

    env is added to (not substituted for) this process's environment. Each command runs in its
    own session, so the terminal's Ctrl-C reaches ddtctl only: a command that was running when
    Ctrl-C came is stopped (SIGTERM to its group, SIGKILL 5 s later) and Interrupted raised;
    commands started afterwards (rollback, clean-up) run to completion (remote/localproc.py).
    Timeout kills the group (SIGKILL) and raises CommandTimeout with the output collected so far."""

    name = "local"

    def __init__(self, name: str = "local"):
        self.name = name

    def run(self, argv: Sequence[str], *, stdin: bytes | None = None,
            timeout: float | None = None, env: Mapping[str, str] | None = None,
            idempotent: bool = False) -> Result:
        items = validate_argv(argv)
        full_env = {**os.environ, **env} if env else None
        interruptible = not cancel.requested()       # begun after Ctrl-C: clean-up, let it finish
        start = time.monotonic()
        try:
            proc = subprocess.Popen(list(items), stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env,
                                    start_new_session=True)
        except OSError as exc:  # program not found / not executable: report like a shell would
            return Result(items, 127 if isinstance(exc, FileNotFoundError) else 126, b"",
                          f"{items[0]}: {exc.strerror}\n".encode(), time.monotonic() - start,
                          self.name)
        return localproc.collect(proc, items, stdin, timeout, self.name, interruptible)

    def stream(self, argv: Sequence[str], *, stdin: BinaryIO | None, stdout: BinaryIO,
               stderr: BinaryIO, timeout: float | None = None,
               env: Mapping[str, str] | None = None) -> int:
        """Run argv relaying bytes as they come; returns its exit status (128+N when killed by
        signal N); see remote/localproc.py for timeout and Ctrl-C."""
        items = validate_argv(argv)
        full_env = {**os.environ, **env} if env else None
        try:
            proc = subprocess.Popen(list(items), stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env,
                                    start_new_session=True, bufsize=0)
        except OSError as exc:
            relay.emit(stderr, f"{items[0]}: {exc.strerror}\n".encode())
            return 127 if isinstance(exc, FileNotFoundError) else 126
        return localproc.relay(proc, stdin, stdout, stderr, timeout)

    def put(self, local: Path, remote: str, *, mode: int = 0o644,
            progress: Progress | None = None) -> PutResult:
        return push_file(_LocalFileOps(self.run, self.name), local, remote, mode=mode,
                         progress=progress)

    @contextlib.contextmanager
    def forward(self, host: str, port: int) -> Iterator[tuple[str, int]]:
        """The address is reachable from here as it is: yields (host, port) unchanged."""
        yield (host, port)

    def close(self) -> None:
        pass

