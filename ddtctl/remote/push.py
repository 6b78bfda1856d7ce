"""Streamed, resumable, sha256-verified file push, written once for every transport.

:func:`push_file` drives a destination through a small set of primitives (:class:`ExecFileOps`):

1. skip when the destination already has the same size and sha256 (idempotent re-runs);
2. resume: ``<dest>.part`` is kept when its sha256 equals the sha256 of the same-length prefix of
   the local file, and only the rest is sent; otherwise it is discarded and sending starts at 0;
3. verify the sha256 of ``<dest>.part`` on the destination with ``sha256sum``;
4. ``chmod`` + atomic ``mv -T`` onto ``<dest>``.

That is ~6 remote commands per file; many small files go together instead (remote/push_many.py).

:class:`ExecFileOps` implements the primitives with fixed argv (``stat``, ``sha256sum``, ``mkdir -p``,
``rm -f``, ``chmod``, ``mv``) run through any ``run`` callable, and writes chunks with
``dd of=<part> bs=1M seek=<offset> oflag=seek_bytes conv=notrunc status=none`` fed on stdin (GNU
coreutils ``dd`` needed on the destination). Transports with a better byte channel (SFTP, local
files) override :meth:`ExecFileOps.write` only.

Deadlines (every step has one; a silent SSH peer is noticed sooner by the keepalive): metadata
commands (``stat``, ``mkdir``, ``rm``, ``chmod``, ``mv``) ``META_TIMEOUT`` s; ``sha256sum``
``hash_timeout(size)`` (60 s + 20 MB/s); each chunk ``CHUNK_TIMEOUT`` s (``dd`` of up to 8 MiB, or
the SFTP acknowledgement of a 1 MiB chunk).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import posixpath
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from ddtctl.errors import RemoteError, TransferError, UnreachableError
from ddtctl.remote.result import PutResult, Result

CHUNK = 1024 * 1024  # bytes read and sent at a time
CHUNK_TIMEOUT = 120.0  # s for one chunk to be written on the destination
META_TIMEOUT = 60.0  # s for stat/mkdir/rm/chmod/mv
Progress = Callable[[int, int], None]  # (bytes done incl. a resumed prefix, bytes total)
RunFn = Callable[..., Result]  # run(argv, *, stdin=None, timeout=None, idempotent=False)

_cache: dict[tuple, str] = {}
_cache_lock = threading.Lock()


def local_sha256(path: Path | str, limit: int | None = None) -> str:
    """Hex sha256 of a local file, or of its first ``limit`` bytes.

    Whole-file digests are cached per (device, inode, size, mtime_ns), so re-runs hash a multi-GB
    weight file once per process. Raises OSError if the file cannot be read."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if limit is None:
        with _cache_lock:
            if key in _cache:
                return _cache[key]
    digest = hashlib.sha256()
    for chunk in read_chunks(path, 0, limit=limit):
        digest.update(chunk)
    hexdigest = digest.hexdigest()
    if limit is None:
        with _cache_lock:
            _cache[key] = hexdigest
    return hexdigest


def read_chunks(path: Path | str, offset: int, size: int = CHUNK, limit: int | None = None
                ) -> Iterator[bytes]:
    """Yield the file's bytes from ``offset`` (bytes) in chunks of ``size`` bytes, up to ``limit``."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        left = None if limit is None else max(0, limit - offset)
        while left is None or left > 0:
            data = fh.read(size if left is None else min(size, left))
            if not data:
                return
            if left is not None:
                left -= len(data)
            yield data


def resume_offset(part_size: int | None, local_size: int, prefix_matches: Callable[[], bool]) -> int:
    """Where to continue an interrupted push (bytes): ``part_size`` if a partial file exists, is not
    longer than the local file and ``prefix_matches()`` (its sha256 equals the local prefix's),
    else 0 (start over)."""
    if not part_size or part_size > local_size:
        return 0
    return part_size if prefix_matches() else 0


def hash_timeout(size: int | None) -> float:
    """Deadline in seconds for ``sha256sum`` of ``size`` bytes: 60 s + 20 MB/s (slow disks)."""
    return 60.0 + (size or 0) / 20e6


def parse_sha256sum(stdout: bytes) -> str:
    """The digest from ``sha256sum`` output (a leading ``\\`` marks an escaped file name).

    Raises ValueError if the output does not start with 64 hex digits."""
    text = stdout.decode("ascii", "replace").lstrip("\\")[:64]
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"unexpected sha256sum output: {stdout[:120]!r}")
    return text


class ExecFileOps:
    """Destination primitives as fixed argv run through ``run``; see the module docstring."""

    def __init__(self, run: RunFn, name: str = ""):
        self._run = run
        self.name = name

    def _do(self, argv: Sequence[str], *, idempotent: bool = False, **kw) -> Result:
        if idempotent:  # a read: the transport may retry it after a dropped connection
            kw["idempotent"] = True
        kw.setdefault("timeout", META_TIMEOUT)
        return self._run(list(argv), **kw)

    def size(self, path: str) -> int | None:
        """Size in bytes of a regular file, None when it does not exist (or is not readable)."""
        res = self._do(["stat", "-L", "-c", "%F:%s", "--", path], idempotent=True)
        if not res.ok:
            return None
        kind, _, size = res.text.strip().rpartition(":")
        return int(size) if kind.startswith("regular") else None

    def sha256(self, path: str, size: int | None = None) -> str | None:
        """Hex sha256 of ``path`` (None when missing); ``size`` (bytes) sets the deadline."""
        res = self._do(["sha256sum", "--", path], idempotent=True, timeout=hash_timeout(size))
        return parse_sha256sum(res.stdout) if res.ok else None

    def makedirs(self, path: str) -> None:
        self._do(["mkdir", "-p", "--", path], idempotent=True).check()

    def remove(self, path: str) -> None:
        self._do(["rm", "-f", "--", path], idempotent=True).check()

    def chmod(self, path: str, mode: int) -> None:
        self._do(["chmod", format(mode, "o"), "--", path], idempotent=True).check()

    def commit(self, part: str, dest: str, mode: int) -> None:
        """chmod ``part`` and rename it atomically onto ``dest`` (same directory)."""
        self.chmod(part, mode)
        self._do(["mv", "-f", "-T", "--", part, dest]).check()

    def write(self, path: str, offset: int, chunks: Iterable[bytes], sent: Callable[[int], None]
              ) -> None:
        """Write chunks into ``path`` starting at byte ``offset``; call ``sent(n)`` after each.
        The file is created even when there are no chunks (empty file)."""
        chunks = iter(chunks)
        for chunk in itertools.chain([next(chunks, b"")], chunks):
            argv = ["dd", f"of={path}", "bs=1M", f"seek={offset}", "oflag=seek_bytes",
                    "conv=notrunc", "status=none"]
            # idempotent: the same bytes at the same offset (notrunc), so a chunk whose connection
            # was lost is sent again over the next one; the final sha256 verifies the whole file
            self._do(argv, stdin=chunk, timeout=CHUNK_TIMEOUT, idempotent=True).check()
            offset += len(chunk)
            sent(len(chunk))


WRITE_ATTEMPTS = 3   # writes of one push: a lost connection resumes from the verified partial file


def push_file(ops: ExecFileOps, local: Path | str, remote: str, *, mode: int = 0o644,
              progress: Progress | None = None, chunk_size: int = CHUNK) -> PutResult:
    """Push ``local`` to the absolute path ``remote`` through ``ops`` (see module docstring).

    mode: permission bits of the final file. progress(done, total) is called after each chunk,
    in bytes. Returns PutResult(bytes_sent, sha256, skipped).
    Raises TransferError when the destination's sha256 differs after the copy (the partial file is
    removed), RemoteError when a primitive fails, ArgvError for a relative ``remote``, OSError
    when the local file cannot be read."""
    if not remote.startswith("/") or remote.endswith("/"):
        raise TransferError(f"{ops.name}: destination must be an absolute file path: {remote!r}")
    total = os.path.getsize(local)
    digest = local_sha256(local)
    if ops.size(remote) == total and ops.sha256(remote, total) == digest:
        ops.chmod(remote, mode)
        return PutResult(0, digest, True)
    ops.makedirs(posixpath.dirname(remote) or "/")
    part = remote + ".part"
    part_size = ops.size(part)
    offset = resume_offset(part_size, total,
                           lambda: ops.sha256(part, part_size) == local_sha256(local, limit=part_size))
    if offset == 0 and part_size is not None:
        ops.remove(part)
        part_size = None
    done = offset
    transferred = 0   # bytes written by this call, over every attempt

    def sent(n: int) -> None:
        nonlocal done, transferred
        done += n
        transferred += n
        if progress:
            progress(done, total)

    for attempt in range(WRITE_ATTEMPTS):
        if not (offset < total or part_size is None):
            break
        try:
            ops.write(part, offset, read_chunks(local, offset, chunk_size), sent)
            break
        except UnreachableError:
            # the node's connection died mid-write (a shared connection under load): resume from
            # what the partial file verifiably holds, over the next connection
            if attempt + 1 == WRITE_ATTEMPTS:
                raise
            part_size = ops.size(part)
            offset = resume_offset(part_size, total,
                                   lambda n=part_size: ops.sha256(part, n) == local_sha256(local, limit=n))
            done = offset
    got = ops.sha256(part, total)
    if got != digest:
        try:
            ops.remove(part)
        except RemoteError:
            pass
        raise TransferError(f"{ops.name}: sha256 mismatch after pushing {local} to {remote}: "
                            f"expected {digest}, destination has {got}")
    ops.commit(part, remote, mode)
    return PutResult(transferred, digest, False)
