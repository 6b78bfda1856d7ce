"""ContainerTransport: an LXC container reached with ``pct exec`` / ``pct push`` on a node Transport.

* ``run(argv)`` runs ``node.run(pct_exec(vmid, argv, env=env))``: ``--keep-env 0 -- /usr/bin/env -i
  HOME=/root LANG=C.UTF-8 LC_ALL=C.UTF-8 PATH=<LXC default> [K=V] argv`` (docs/operations.md
  §13.2); no shell is added inside the CT, the node's login shell is the only one
  (docs/operations.md §13.1). pct's own failures (CT not running, not on this node) exit non-zero
  (usually 255) with pct's message on stderr; 128+N means the command was killed by signal N.
* ``put()`` below ``SMALL_FILE`` bytes (8 MiB): stage on the node with ``node.put`` (SFTP, verified),
  ``pct exec -- mkdir -p <parent>``, ``pct push <staging> <dest>.part``, then ALWAYS verify with
  ``pct exec -- sha256sum`` because pct push can exit 0 after a failed copy (``TASK ERROR`` on
  stderr, docs/operations.md §13.3), then ``chmod`` + ``mv -T`` to ``<dest>``; the staging file
  is removed.
* ``put()`` of larger files: no staging copy on the node disk; chunks are streamed through
  ``pct exec <vmid> -- dd of=<dest>.part bs=1M seek=<offset> oflag=seek_bytes conv=notrunc
  status=none`` on stdin, resumable from the partial file's size after comparing its sha256 with
  the local prefix, verified, renamed (remote/push.py). Pushes to one container are serialised
  (pct push holds the CT config lock for the whole copy).
* ``forward(host, port)`` delegates to the node: host must be the container's address as the node
  sees it (from the inventory).
* ``stream(argv, ...)`` (``ddtctl exec``): ``pct exec`` relayed byte for byte both ways; with a
  timeout the command runs under ``timeout -k 5 -- N`` INSIDE the container, so it is the
  container's process that is stopped (exit 124 as timeout(1)).
* Deadlines: ``pct push`` PCT_PUSH_TIMEOUT s (a small file; pct holds the CT lock meanwhile), the
  staging clean-up META_TIMEOUT s, the primitives as in remote/push.py.
"""

from __future__ import annotations

import os
import posixpath
import threading
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, ContextManager

from ddtctl.errors import DdtctlError, TransferError
from ddtctl.remote.command import pct_exec, pct_push, timeout_argv
from ddtctl.remote.push import CHUNK, META_TIMEOUT, ExecFileOps, Progress, local_sha256, push_file
from ddtctl.remote.result import PutResult, Result
from ddtctl.remote.transport import Transport

SMALL_FILE = 8 * 1024 * 1024  # bytes; at or above this, stream instead of pct push
STREAM_CHUNK = 8 * CHUNK  # bytes per `pct exec -- dd` call when streaming
PCT_PUSH_TIMEOUT = 300.0  # s for `pct push` of a file below SMALL_FILE
_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


class ContainerTransport:
    """Container ``vmid`` on ``node``; name "ct<vmid>@<node name>".

    Errors: as the node transport's run (UnreachableError, CommandTimeout); put raises
    TransferError when the pushed file does not verify, RemoteError when a step fails."""

    def __init__(self, node: Transport, vmid: int | str, *, name: str | None = None,
                 staging_dir: str = "/tmp"):
        self.node = node
        self.vmid = int(vmid)
        node_name = node.name.split(":", 1)[-1]
        self.name = name or f"ct{self.vmid}@{node_name}"
        self.staging_dir = staging_dir
        with _locks_guard:
            self._push_lock = _locks.setdefault((node.name, str(self.vmid)), threading.Lock())

    def run(self, argv: Sequence[str], *, stdin: bytes | None = None,
            timeout: float | None = None, env: Mapping[str, str] | None = None,
            idempotent: bool = False) -> Result:
        """Run argv inside the container (see module docstring). The Result keeps the caller's
        argv and this transport's name."""
        kwargs = {"idempotent": True} if idempotent else {}
        res = self.node.run(pct_exec(self.vmid, argv, env=env), stdin=stdin, timeout=timeout,
                            **kwargs)
        return Result(tuple(argv), res.exit_code, res.stdout, res.stderr, res.seconds, self.name)

    def stream(self, argv: Sequence[str], *, stdin: BinaryIO | None, stdout: BinaryIO,
               stderr: BinaryIO, timeout: float | None = None,
               env: Mapping[str, str] | None = None) -> int:
        """Run argv in the container relaying bytes as they come (see module docstring); returns
        its exit status. Raises as the node transport's ``stream``."""
        inner = timeout_argv(argv, timeout) if timeout else argv
        return self.node.stream(pct_exec(self.vmid, inner, env=env), stdin=stdin, stdout=stdout,
                                stderr=stderr, timeout=timeout, wrap_timeout=False)

    def put(self, local: Path, remote: str, *, mode: int = 0o644,
            progress: Progress | None = None) -> PutResult:
        """Push a local file to the absolute path ``remote`` in the container; see module doc."""
        ops = ExecFileOps(self.run, self.name)  # every primitive via pct exec; dd chunks
        with self._push_lock:
            if os.path.getsize(local) >= SMALL_FILE:
                return push_file(ops, local, remote, mode=mode, progress=progress,
                                 chunk_size=STREAM_CHUNK)
            return self._put_small(ops, Path(local), remote, mode, progress)

    def _put_small(self, ops: ExecFileOps, local: Path, remote: str, mode: int,
                   progress: Progress | None) -> PutResult:
        if not remote.startswith("/") or remote.endswith("/"):
            raise TransferError(f"{self.name}: destination must be an absolute file path: {remote!r}")
        digest, size = local_sha256(local), os.path.getsize(local)
        if ops.size(remote) == size and ops.sha256(remote, size) == digest:
            ops.chmod(remote, mode)
            return PutResult(0, digest, True)
        staging = posixpath.join(self.staging_dir, f"ddtctl-{uuid.uuid4().hex}-{local.name}")
        part = remote + ".part"
        try:
            self.node.put(local, staging, mode=0o600)
            ops.makedirs(posixpath.dirname(remote) or "/")
            res = self.node.run(pct_push(self.vmid, staging, part, perms=0o600), timeout=PCT_PUSH_TIMEOUT,
                                idempotent=True)      # rewrites <dest>.part; verified below
            got = ops.sha256(part, size)  # pct push may exit 0 after a failed copy: verify, always
            if not res.ok or got != digest:
                self.run(["rm", "-f", "--", part], timeout=META_TIMEOUT)
                detail = res.err_text.strip() or f"sha256 {got} != {digest}"
                raise TransferError(f"{self.name}: pct push of {local} to {remote} failed "
                                    f"(exit {res.exit_code}): {detail}", res)
            ops.commit(part, remote, mode)
        finally:
            try:
                self.node.run(["rm", "-f", "--", staging], timeout=META_TIMEOUT)
            except DdtctlError:
                pass  # the node went away: the push's own error is the one to report
        if progress:
            progress(size, size)
        return PutResult(size, digest, False)

    def forward(self, host: str, port: int) -> ContextManager[tuple[str, int]]:
        """The node's forward to host:port (host = the container's address seen from the node)."""
        return self.node.forward(host, port)

    def close(self) -> None:
        """Nothing of its own to release; the node transport is closed by its owner."""

