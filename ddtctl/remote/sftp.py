"""SFTP as the byte channel of a push to a node (remote/push.py drives it; SshTransport.put).

Each chunk must be acknowledged within CHUNK_TIMEOUT s (a live peer that stalls: CommandTimeout,
exit 1); a peer that falls silent is closed by the keepalive and one that dies ends the write at
once: both UnreachableError (exit 3), never a Paramiko exception.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import paramiko

from ddtctl.errors import CommandTimeout
from ddtctl.remote.push import CHUNK_TIMEOUT, ExecFileOps


class SftpFileOps(ExecFileOps):
    """Push primitives on a node: fixed argv over ``ssh.run``, chunks written over SFTP. ``ssh``: the
    node's SshTransport (remote/ssh.py, which creates this object; not imported here)."""

    def __init__(self, ssh: Any):
        super().__init__(ssh.run, ssh.name)
        self._ssh = ssh

    def write(self, path: str, offset: int, chunks: Iterable[bytes],
              sent: Callable[[int], None]) -> None:
        ssh = self._ssh
        transport = ssh.transport()
        try:
            with ssh._slots:
                chan = transport.open_session(timeout=ssh.config().connect_timeout)
                chan.settimeout(CHUNK_TIMEOUT)
                chan.invoke_subsystem("sftp")
                with paramiko.SFTPClient(chan) as sftp, sftp.open(path, "r+b" if offset else "wb") as fh:
                    fh.set_pipelined(True)
                    fh.seek(offset)
                    for chunk in chunks:
                        fh.write(chunk)
                        sent(len(chunk))
        except TimeoutError:
            if not transport.is_active():
                raise ssh._unreachable(transport, f"pushing {path}", Exception("timeout")) from None
            raise CommandTimeout(f"{ssh.name}: SFTP push to {path} stalled: no acknowledgement in "
                                 f"{CHUNK_TIMEOUT:g} s") from None
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if transport.is_active() and isinstance(exc, OSError) and not isinstance(exc, EOFError):
                raise
            ssh._drop(transport)
            raise ssh._unreachable(transport, f"pushing {path}", exc) from None
