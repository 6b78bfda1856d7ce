"""SshTransport: a node reached over SSH with Paramiko, configured by OpenSSH's own evaluation of the
operator's ssh_config (remote/sshconfig.py) and connected like ssh(1) (remote/sshconnect.py).

* One connection per node, opened lazily and shared by all threads; at most ``max_channels``
  (default 8) concurrent channels, below OpenSSH's ``MaxSessions`` 10.
* Deadlines: connect, banner, key exchange and authentication each within ConnectTimeout (ddtctl
  default 10 s); every hop is watched by a keepalive (remote/keepalive.py: ServerAliveInterval x
  ServerAliveCountMax, ddtctl default 10 s x 3), so a peer that stops answering while its TCP
  connection stays open is noticed within ~30 s and every wait on it ends. Commands take a
  ``timeout``; pushes have per-chunk deadlines (remote/push.py).
* Once the peer was silent, the next call reconnects once (no retries); when that fails too, the
  node is unreachable for the rest of this transport's life: every later call fails at once with
  the same UnreachableError (so rollback and lock release on a dead node cost no more waiting).
* ``run(argv)`` sends exactly ``shell_join(argv)`` as the exec request (the remote login shell is
  the one shell that parses it); never a pty; stdin closed at once unless bytes are given.
  ``stream(argv, ...)`` relays bytes both ways as they come (``ddtctl exec``, remote/relay.py).
* Retries (tenacity, exponential backoff with jitter): connection refused/reset (not a silent peer:
  it already had its ConnectTimeout) and opening a channel (the command has not started); a
  connection lost while a command runs only when the caller passes ``idempotent=True``.
* ``put()``: SFTP into ``<dest>.part``, resumable, sha256 verified, atomic rename (remote/push.py).
  ``forward()``: remote/forward.py.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import paramiko
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from ddtctl.errors import CommandTimeout, DdtctlError, UnreachableError
from ddtctl.output import info
from ddtctl.remote import relay
from ddtctl.remote.command import shell_join, timeout_argv, with_env
from ddtctl.remote.forward import forward_local
from ddtctl.remote.keepalive import Keepalive
from ddtctl.remote.push import Progress, push_file
from ddtctl.remote.result import PutResult, Result
from ddtctl.remote.sftp import SftpFileOps
from ddtctl.remote.sshconfig import HostConfig, resolve
from ddtctl.remote.sshconnect import ConnectFailed, open_chain

# Paramiko logs connection failures with tracebacks; ddtctl reports them itself, in one line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
EXIT_GRACE = 2.0  # s to wait for EOF after the exit status (a background child may hold stdout)
POLICY_WORDS = {"strict": "yes"}  # older ddtctl spelling of StrictHostKeyChecking yes


class _Transient(Exception):
    """A transport-level failure that is safe to retry (wraps the cause)."""


class _NotStarted(_Transient):
    """The channel could not be opened: the command did not run."""


class _Dropped(_Transient):
    """The connection died while the command ran: it may or may not have completed."""


class SshTransport:
    """A Proxmox node (or any Linux host) over SSH; see the module docstring.

    host: an alias from the ssh config or a hostname. user/port: like ``ssh -l``/``-p``.
    options: ssh_config options given like ``ssh -o`` (inventory ``ssh_options``); identity_file,
    known_hosts (UserKnownHostsFile), host_key_policy (StrictHostKeyChecking; "strict" = "yes")
    and connect_timeout (s) are shorthands for options. ssh_config: a file used INSTEAD of
    ``~/.ssh/config`` and ``/etc/ssh/ssh_config`` (``ssh -F``). notify(line): where ssh's
    informational lines go (a host key added); default: ddtctl's stderr.
    Errors: UsageError (invalid ssh configuration), UnreachableError (connect/auth, silent peer),
    HostKeyError (unknown where OpenSSH would refuse, changed, revoked), CommandTimeout,
    RemoteError/TransferError from put."""

    def __init__(self, host: str, *, user: str | None = None, port: int | None = None,
                 identity_file: str | Path | None = None, known_hosts: str | Path | None = None,
                 ssh_config: str | Path | None = None, host_key_policy: str | None = None,
                 connect_timeout: float | None = None, options: Mapping[str, str] | None = None,
                 max_channels: int = 8, attempts: int = 3, name: str | None = None,
                 notify: Callable[[str], None] | None = None):
        self.host, self.user, self.port = host, user, port
        opts: dict[str, str] = {}
        for key, value in (("IdentityFile", identity_file), ("UserKnownHostsFile", known_hosts),
                           ("StrictHostKeyChecking", host_key_policy),
                           ("ConnectTimeout", connect_timeout)):
            if value is not None:
                text = str(value)
                opts[key] = POLICY_WORDS.get(text, text) if key == "StrictHostKeyChecking" else text
        for key, value in (options or {}).items():
            if key.lower() not in {k.lower() for k in opts}:
                opts[key] = str(value)
        self.options = opts
        self.ssh_config = str(ssh_config) if ssh_config else None
        self.attempts = attempts
        self.name = name or f"node:{host}"
        self.notify = notify or _default_notify
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_channels)
        self._chain: list[tuple[paramiko.Transport, HostConfig]] = []
        self._watch: list[Keepalive] = []
        self._cfg: HostConfig | None = None
        self._lost: str | None = None       # why the last connection ended (a silent peer)
        self._dead: UnreachableError | None = None

    # -- connection ------------------------------------------------------------------------
    def config(self) -> HostConfig:
        """The evaluated ssh configuration of the node (``ssh -G``); cached."""
        if self._cfg is None:
            self._cfg = resolve(self.host, config_file=self.ssh_config, user=self.user, port=self.port,
                                options=self.options)
        return self._cfg

    def _resolve_hop(self, host: str, *, user=None, port=None, jump=None) -> HostConfig:
        return resolve(host, config_file=self.ssh_config, user=user, port=port, jump=jump)

    def transport(self) -> paramiko.Transport:
        """The live Paramiko transport, connecting if needed (see the module docstring)."""
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if self._chain and self._chain[-1][0].is_active():
                return self._chain[-1][0]
            lost = self._silence() or self._lost
            self._close_chain()
            try:
                self._chain = self._connect(1 if lost else self.attempts)
            except UnreachableError as exc:
                self._dead = exc
                raise
            self._lost = None
            self._watch = [Keepalive(t, c.alive_interval, c.alive_count, f"{self.name} {c.name}")
                           for t, c in self._chain]
            return self._chain[-1][0]

    def _connect(self, attempts: int) -> list[tuple[paramiko.Transport, HostConfig]]:
        cfg = self.config()
        for attempt in range(1, attempts + 1):
            try:
                return open_chain(cfg, self._resolve_hop, self.notify)
            except ConnectFailed as exc:
                if exc.silent:
                    raise UnreachableError(f"{self.name}: unreachable (no answer in "
                                           f"{cfg.connect_timeout:g} s): {exc} {cfg.dest}") from None
                if attempt == attempts:
                    raise UnreachableError(f"{self.name}: cannot connect to {cfg.dest}: {exc}") from None
                time.sleep(min(3.0, 0.2 * 2 ** attempt))
            except DdtctlError as exc:
                if isinstance(exc, UnreachableError) and not str(exc).startswith(self.name):
                    raise type(exc)(f"{self.name}: {exc}") from None
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _silence(self) -> str | None:
        return next((w.reason for w in self._watch if w.reason), None)

    def _lost_reason(self, dead: paramiko.Transport) -> str | None:
        """Why ``dead`` ended, when the keepalive closed it (e.g. "no answer in 30 s")."""
        with self._lock:
            if self._chain and self._chain[-1][0] is dead:
                return self._silence()
        return self._lost

    def _drop(self, dead: paramiko.Transport) -> None:
        with self._lock:
            if self._chain and self._chain[-1][0] is dead:
                self._lost = self._silence() or self._lost
                self._close_chain()

    def _close_chain(self) -> None:
        for watch in self._watch:
            watch.stop()
        self._watch = []
        for t, _ in reversed(self._chain):
            try:
                t.close()
            except Exception:  # noqa: BLE001 - closing a broken connection must not raise
                pass
        self._chain = []

    def close(self) -> None:
        with self._lock:
            self._close_chain()

    def _unreachable(self, transport: paramiko.Transport, what: str, exc: Exception) -> UnreachableError:
        why = self._lost_reason(transport)
        if why:
            return UnreachableError(f"{self.name}: unreachable ({why}) {what}")
        return UnreachableError(f"{self.name}: connection lost {what}: {exc}")

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
            transport = exc.args[1] if len(exc.args) > 1 else None
            raise self._unreachable(transport, f"while running {items[0]}", exc.args[0]) from None

    def _retrying(self, kind: type[Exception]) -> Retrying:
        return Retrying(retry=retry_if_exception_type(kind), reraise=True,
                        stop=stop_after_attempt(max(2, self.attempts)),
                        wait=wait_random_exponential(multiplier=0.2, max=3))

    def _open(self, command: str) -> tuple[paramiko.Transport, paramiko.Channel]:
        transport = self.transport()
        try:
            chan = transport.open_session(timeout=self.config().connect_timeout)
            chan.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            self._drop(transport)
            raise _NotStarted(repr(exc), transport) from exc
        return transport, chan

    def _exec(self, items: tuple[str, ...], command: str, stdin: bytes | None,
              timeout: float | None) -> Result:
        transport, chan = self._open(command)
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
                raise _Dropped("connection lost", transport)
        writer.join(1)
        code = chan.recv_exit_status()
        if code == -1 and not transport.is_active():  # closed by the dying connection
            self._drop(transport)
            raise _Dropped("connection lost", transport)
        return Result(items, code, bytes(out), bytes(err), time.monotonic() - start, self.name)

    def stream(self, argv: Sequence[str], *, stdin: BinaryIO | None, stdout: BinaryIO,
               stderr: BinaryIO, timeout: float | None = None,
               env: Mapping[str, str] | None = None, wrap_timeout: bool = True) -> int:
        """Run argv with its output relayed to ``stdout``/``stderr`` as it arrives and ``stdin``
        forwarded (EOF included); returns the exit status (remote/relay.py). With ``timeout``
        the command runs under ``timeout -k 5 -- N`` (timeout(1): exit 124, 137 when it had to
        be killed) unless ``wrap_timeout`` is False (the caller wrapped it). Raises
        UnreachableError when the node is lost, cancel.Interrupted on Ctrl-C."""
        items = tuple(with_env(timeout_argv(argv, timeout) if timeout and wrap_timeout else argv, env))
        try:
            with self._slots:
                transport, chan = self._retrying(_NotStarted)(self._open, shell_join(items))
        except _Transient as exc:
            raise self._unreachable(exc.args[1], f"starting {items[0]}", exc.args[0]) from None
        with chan:
            outcome = relay.relay_channel(chan, transport, stdin, stdout, stderr,
                                          relay.client_deadline(timeout))
        if outcome == relay.LOST:
            self._drop(transport)
            raise self._unreachable(transport, f"while running {items[0]}", Exception("EOF"))
        return outcome

    # -- files and ports -------------------------------------------------------------------
    def put(self, local: Path, remote: str, *, mode: int = 0o644,
            progress: Progress | None = None) -> PutResult:
        """Push a local file to an absolute path on the node over SFTP; see remote/push.py."""
        return push_file(SftpFileOps(self), local, remote, mode=mode, progress=progress)

    @contextmanager
    def forward(self, host: str, port: int) -> Iterator[tuple[str, int]]:
        """127.0.0.1:<free port> tunnelled to host:port as seen from the node."""
        with forward_local(self.transport, host, port,
                           open_timeout=self.config().connect_timeout) as addr:
            yield addr


def _default_notify(line: str) -> None:
    info(line)  # output.py: the transport layer prints nothing else


def _feed(chan: paramiko.Channel, data: bytes | None) -> None:
    try:
        if data:
            chan.sendall(data)
        chan.shutdown_write()
    except (OSError, EOFError, paramiko.SSHException):
        pass  # the command exited without reading all of stdin
