"""SshTransport: a node reached over SSH with Fabric (connection, ~/.ssh/config) and Paramiko
(channels, SFTP).

* One connection per node, opened lazily and shared by all threads; at most ``max_channels``
  (default 8) concurrent channels, below OpenSSH's ``MaxSessions`` 10 (ops.md §1.7).
* ``~/.ssh/config`` (or ``ssh_config=``) is honoured by Fabric: HostName, User, Port,
  IdentityFile, ConnectTimeout and ProxyJump (a chain of gateway Connections over
  ``direct-tcpip``). ``UserKnownHostsFile`` (first entry) is honoured for host keys.
* Host keys: ``accept-new`` (default) or ``strict``, on the target and every jump host
  (remote/hostkeys.py). Connect/banner/auth timeout ``connect_timeout`` (default 10 s); keepalive
  every ``keepalive`` seconds (default 15).
* ``run(argv)`` sends exactly ``shell_join(argv)`` as the exec request (the remote login shell is
  the one shell that parses it, ops.md §1.3); never a pty, so stdout/stderr stay separate and
  binary stdin is safe; stdin is closed at once unless bytes are given.
* Retries (tenacity, exponential backoff with jitter): connecting, and opening a channel (the
  command has not started), always; a connection lost while a command runs only when the caller
  passes ``idempotent=True``. A command that ran and failed is never retried.
* ``put()``: SFTP into ``<dest>.part``, resumable, sha256 verified with ``sha256sum`` on the node,
  atomic rename (remote/push.py). ``forward()``: remote/forward.py.
"""

from __future__ import annotations

import math
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import fabric
import paramiko
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from ddtctl.errors import CommandTimeout, DdtctlError, UnreachableError
from ddtctl.remote.command import shell_join, with_env
from ddtctl.remote.forward import forward_local
from ddtctl.remote.hostkeys import changed_key_error, prepare_client
from ddtctl.remote.push import ExecFileOps, Progress, push_file
from ddtctl.remote.result import PutResult, Result

EXIT_GRACE = 2.0  # s to wait for EOF after the exit status (a background child may hold stdout)


class _Transient(Exception):
    """A transport-level failure that is safe to retry (wraps the cause)."""


class _NotStarted(_Transient):
    """The channel could not be opened: the command did not run."""


class _Dropped(_Transient):
    """The connection died while the command ran: it may or may not have completed."""


def _gateways(conn: fabric.Connection) -> Iterator[fabric.Connection]:
    while isinstance(conn, fabric.Connection):
        yield conn
        conn = conn.gateway


class SshTransport:
    """A Proxmox node (or any Linux host) over SSH; see the module docstring.

    host: an alias from ssh config or a hostname. user/port/identity_file override ssh config.
    known_hosts: the file checked and appended to (default: ssh config UserKnownHostsFile, else
    ``~/.ssh/known_hosts``). ssh_config: a config file used INSTEAD of ``~/.ssh/config`` and
    ``/etc/ssh/ssh_config``. Timeouts are seconds.
    Errors: UnreachableError (connect/auth, after retries), HostKeyError (unknown in strict mode,
    changed key), CommandTimeout, RemoteError/TransferError from put."""

    def __init__(self, host: str, *, user: str | None = None, port: int | None = None,
                 identity_file: str | Path | None = None, known_hosts: str | Path | None = None,
                 ssh_config: str | Path | None = None, host_key_policy: str = "accept-new",
                 connect_timeout: float = 10.0, keepalive: int = 15, max_channels: int = 8,
                 attempts: int = 3, name: str | None = None):
        self.host, self.user, self.port = host, user, port
        self.identity_file = str(identity_file) if identity_file else None
        self.known_hosts = Path(known_hosts).expanduser() if known_hosts else None
        self.ssh_config = str(ssh_config) if ssh_config else None
        self.host_key_policy = host_key_policy
        self.connect_timeout, self.keepalive, self.attempts = connect_timeout, keepalive, attempts
        self.name = name or f"node:{host}"
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_channels)
        self._conn: fabric.Connection | None = None

    # -- connection ------------------------------------------------------------------------
    def _new_connection(self) -> fabric.Connection:
        secs = max(1, math.ceil(self.connect_timeout))
        kwargs: dict = {"banner_timeout": self.connect_timeout, "auth_timeout": self.connect_timeout}
        if self.identity_file:
            kwargs["key_filename"] = [self.identity_file]
        config = fabric.Config(overrides={"timeouts": {"connect": secs}, "connect_kwargs": kwargs},
                               runtime_ssh_path=self.ssh_config)
        conn = fabric.Connection(self.host, user=self.user, port=self.port, config=config,
                                 connect_timeout=secs)
        if self.known_hosts is None:
            listed = conn.ssh_config.get("userknownhostsfile", "~/.ssh/known_hosts").split()
            self.known_hosts = Path(listed[0] if listed else "~/.ssh/known_hosts").expanduser()
        for hop in _gateways(conn):
            prepare_client(hop.client, self.host_key_policy, self.known_hosts)
        return conn

    def _open(self) -> fabric.Connection:
        conn = self._new_connection()
        try:
            conn.open()
            for hop in _gateways(conn):
                hop.transport.set_keepalive(self.keepalive)
            return conn
        except paramiko.BadHostKeyException as exc:  # the target or one of its jump hosts
            port = next((h.port for h in _gateways(conn) if h.host == exc.hostname), conn.port)
            raise changed_key_error(exc, exc.hostname, int(port), self.known_hosts) from None
        except DdtctlError:
            raise
        except paramiko.AuthenticationException as exc:
            raise UnreachableError(f"{self.name}: authentication failed for "
                                   f"{conn.user}@{conn.host}:{conn.port}: {exc}") from None
        except socket.gaierror as exc:
            raise UnreachableError(f"{self.name}: cannot resolve {conn.host}: {exc}") from None
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise _Transient(f"{conn.user}@{conn.host}:{conn.port}: {exc!r}") from exc
        finally:
            if not conn.is_connected:
                self._close_conn(conn)

    def _retrying(self, kind: type[Exception], attempts: int | None = None) -> Retrying:
        return Retrying(retry=retry_if_exception_type(kind), reraise=True,
                        stop=stop_after_attempt(attempts or self.attempts),
                        wait=wait_random_exponential(multiplier=0.2, max=3))

    def transport(self) -> paramiko.Transport:
        """The live Paramiko transport, connecting (with retries) if needed."""
        with self._lock:
            if self._conn is not None and self._conn.transport is not None \
                    and self._conn.transport.is_active():
                return self._conn.transport
            if self._conn is not None:
                self._close_conn(self._conn)
            try:
                self._conn = self._retrying(_Transient)(self._open)
            except _Transient as exc:
                raise UnreachableError(f"{self.name}: cannot connect: {exc}") from None
            return self._conn.transport

    def _drop(self, dead: paramiko.Transport) -> None:
        with self._lock:
            if self._conn is not None and self._conn.transport is dead:
                self._close_conn(self._conn)
                self._conn = None

    @staticmethod
    def _close_conn(conn: fabric.Connection) -> None:
        for hop in _gateways(conn):
            try:
                hop.close()
            except Exception:  # noqa: BLE001 - closing a broken connection must not raise
                pass

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._close_conn(self._conn)
                self._conn = None

    # -- commands --------------------------------------------------------------------------
    def run(self, argv: Sequence[str], *, stdin: bytes | None = None,
            timeout: float | None = None, env: Mapping[str, str] | None = None,
            idempotent: bool = False) -> Result:
        """Run argv on the node; see Transport.run. ``idempotent=True`` allows a retry when the
        connection drops while the command runs. Raises CommandTimeout after ``timeout`` s."""
        items = tuple(with_env(argv, env))
        command = shell_join(items)
        kind = _Transient if idempotent else _NotStarted
        try:
            with self._slots:
                return self._retrying(kind)(self._exec, items, command, stdin, timeout)
        except _Transient as exc:
            raise UnreachableError(f"{self.name}: connection failed running {items[0]}: {exc}") \
                from None

    def _exec(self, items: tuple[str, ...], command: str, stdin: bytes | None,
              timeout: float | None) -> Result:
        transport = self.transport()
        try:
            chan = transport.open_session(timeout=self.connect_timeout)
            chan.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            self._drop(transport)
            raise _NotStarted(repr(exc)) from exc
        with chan:
            return self._collect(transport, chan, items, stdin, timeout)

    def _collect(self, transport: paramiko.Transport, chan: paramiko.Channel,
                 items: tuple[str, ...], stdin: bytes | None, timeout: float | None) -> Result:
        start = time.monotonic()
        writer = threading.Thread(target=_feed, args=(chan, stdin), daemon=True)
        writer.start()
        out, err = bytearray(), bytearray()
        exited_at = None
        while True:
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                chan.close()
                partial = Result(items, -1, bytes(out), bytes(err), now - start, self.name)
                raise CommandTimeout(f"{self.name}: timed out after {timeout} s: {items[0]}",
                                     partial)
            select.select([chan], [], [], 0.2)
            while chan.recv_ready():
                out += chan.recv(65536)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            if chan.exit_status_ready():
                exited_at = exited_at or now
                if chan.eof_received or chan.closed or now - exited_at > EXIT_GRACE:
                    if not (chan.recv_ready() or chan.recv_stderr_ready()):
                        break
            elif not transport.is_active() or chan.closed:
                self._drop(transport)
                raise _Dropped(f"connection lost while running {items[0]}")
        writer.join(1)
        code = chan.recv_exit_status()
        if code == -1 and not transport.is_active():  # closed by the dying connection
            self._drop(transport)
            raise _Dropped(f"connection lost while running {items[0]}")
        return Result(items, code, bytes(out), bytes(err), time.monotonic() - start, self.name)

    # -- files and ports -------------------------------------------------------------------
    def put(self, local: Path, remote: str, *, mode: int = 0o644,
            progress: Progress | None = None) -> PutResult:
        """Push a local file to an absolute path on the node over SFTP; see remote/push.py."""
        return push_file(_SftpFileOps(self), local, remote, mode=mode, progress=progress)

    @contextmanager
    def forward(self, host: str, port: int) -> Iterator[tuple[str, int]]:
        """127.0.0.1:<free port> tunnelled to host:port as seen from the node."""
        with forward_local(self.transport, host, port) as addr:
            yield addr


def _feed(chan: paramiko.Channel, data: bytes | None) -> None:
    try:
        if data:
            chan.sendall(data)
        chan.shutdown_write()
    except (OSError, EOFError, paramiko.SSHException):
        pass  # the command exited without reading all of stdin


class _SftpFileOps(ExecFileOps):
    def __init__(self, ssh: SshTransport):
        super().__init__(ssh.run, ssh.name)
        self._ssh = ssh

    def write(self, path: str, offset: int, chunks: Iterable[bytes],
              sent: Callable[[int], None]) -> None:
        with self._ssh._slots, paramiko.SFTPClient.from_transport(self._ssh.transport()) as sftp:
            with sftp.open(path, "r+b" if offset else "wb") as fh:
                fh.set_pipelined(True)
                fh.seek(offset)
                for chunk in chunks:
                    fh.write(chunk)
                    sent(len(chunk))

