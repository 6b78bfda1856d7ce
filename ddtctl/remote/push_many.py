"""Many small files in one go: one tar stream, one ``sha256sum``, one ``mv`` per target folder.

:func:`push_many` places files under a folder of any Transport (local, a node over SSH, a
container through ``pct exec``) with a constant number of remote commands per batch instead of
the ~6 per file of :func:`ddtctl.remote.push.push_file` (each a round trip, a ``pct exec``
through SSH into a container). Each batch (at most BATCH_BYTES bytes, ARGV_BYTES of paths):

1. ``mkdir -p -- <folder>/.incoming-<random> <new parent folders>``;
2. ``tar -x -f - -C <staging> --no-same-owner -p -m`` fed ONE tar stream on stdin (written here by
   :mod:`tarfile`, GNU format: names as their UTF-8 bytes, never converted by the target's locale;
   members mode 0644), through ``Transport.stream``;
3. ``sha256sum -- <staged files>``, compared with the local digests: a mismatch fails the batch
   before any file is placed;
4. ``mv -f -t <parent> -- <staged files>`` per final parent folder (one for a flat folder such
   as a wheelhouse): rename(2) of each verified file onto its final name, so a name holds either
   its old content or its new, verified one, never a half-written file;
5. ``rm -rf -- <staging>``.

Any failure (a killed or frozen peer, a full disk, a hash mismatch, a closed pipe, a deadline)
removes the staging folder when the destination still answers, leaves every final name of the
batch as it was (only a failure inside step 4, or a later batch's, can leave some names with
their new, verified content: never a half-written file), and raises what push_file raises: TransferError (tar failed, sha256 mismatch), RemoteError /
CommandTimeout (a step failed or ran out of time), UnreachableError (the connection is gone;
the stream is retried over a new connection, WRITE_ATTEMPTS in all, as push_file's writes are),
OSError (a local file cannot be read). A staging folder that could not be removed (the peer
died) is ignored by later syncs (dot folders are never part of a manifest) and removed by
:func:`clean_stale` once older than STALE_MINUTES (never a running batch's: a concurrent sync
into the same folder keeps its own staging folder).

Deadlines: mkdir, mv, rm META_TIMEOUT s each; the tar stream CHUNK_TIMEOUT s + bytes /
STREAM_RATE (also enforced inside the destination by ``timeout(1)`` for SSH and pct);
``sha256sum`` ``hash_timeout(bytes)``. Destinations need GNU tar and coreutils.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ddtctl.errors import CommandTimeout, DdtctlError, TransferError, UnreachableError
from ddtctl.remote.push import (CHUNK, CHUNK_TIMEOUT, META_TIMEOUT, WRITE_ATTEMPTS, Progress, hash_timeout,
                                parse_sha256sum)

SMALL_FILE = 8 * 1024 * 1024       # bytes; smaller files go in a batch, larger ones through put()
BATCH_BYTES = 64 * 1024 * 1024     # bytes of file data in one tar stream at most
ARGV_BYTES = 64 * 1024             # bytes of paths in one sha256sum / mv argv at most
STREAM_RATE = 500_000              # bytes/s: the slowest link a tar stream is given time for
STAGING = ".incoming-"             # staging folder prefix, in the destination folder
STALE_MINUTES = 60                 # a staging folder this old is a dead run's leftover
TAR_ARGS = ("--no-same-owner", "-p", "-m")   # owned by the extracting user, mode as sent, mtime now

Item = tuple[Path, str, str]       # (local file, path relative to the folder, its sha256 hex)


def batches(items: Sequence[Item], sizes: Sequence[int]) -> list[list[int]]:
    """Indexes of ``items`` grouped into batches of at most BATCH_BYTES bytes and ARGV_BYTES of
    paths (a single bigger file still gets a batch of its own) (pure)."""
    out: list[list[int]] = []
    group: list[int] = []
    total = names = 0
    for i, (_, rel, _) in enumerate(items):
        cost = len(rel.encode()) + 80            # + the folder and staging prefix of each path
        if group and (total + sizes[i] > BATCH_BYTES or names + cost > ARGV_BYTES):
            out.append(group)
            group, total, names = [], 0, 0
        group.append(i)
        total += sizes[i]
        names += cost
    return out + [group] if group else out


class _TarReader(io.RawIOBase):
    """A tar stream of ``items`` read on demand (``read1``; no fileno, so the relays pull from it
    in their stdin thread); counts bytes for ``progress`` and keeps a local read error."""

    def __init__(self, items: Sequence[Item], progress: Callable[[int], None] | None = None):
        self._chunks = self._generate(items)
        self._buf, self._pos = b"", 0
        self._progress = progress
        self.error: BaseException | None = None
        self._pending: list[bytes] = []

    def readable(self) -> bool:
        return True

    def write(self, data) -> int:            # tarfile's sink (called inside _generate)
        self._pending.append(bytes(data))
        return len(data)

    def _generate(self, items: Sequence[Item]) -> Iterator[bytes]:
        with tarfile.open(fileobj=self, mode="w|", format=tarfile.GNU_FORMAT, bufsize=CHUNK,
                          encoding="utf-8", errors="surrogateescape") as tar:
            for local, rel, _ in items:
                with open(local, "rb") as fh:
                    info = tarfile.TarInfo(rel)
                    info.size, info.mode, info.type = Path(local).stat().st_size, 0o644, tarfile.REGTYPE
                    tar.addfile(info, fh)
                yield from self._drain()
        yield from self._drain()

    def _drain(self) -> Iterator[bytes]:
        pending, self._pending = self._pending, []
        for data in pending:
            if self._progress:
                self._progress(len(data))
            yield data

    def read1(self, size: int = -1) -> bytes:
        try:
            while self._pos >= len(self._buf):
                self._buf, self._pos = next(self._chunks, b""), 0
                if not self._buf:
                    return b""
        except Exception as exc:                 # noqa: BLE001 - ends the stream; raised by push_many
            self.error = exc
            raise OSError(f"reading the local files failed: {exc}") from exc
        n = 65536 if size is None or size < 0 else min(size, 65536)
        data = self._buf[self._pos:self._pos + n]
        self._pos += len(data)
        return data

    def read(self, size: int = -1) -> bytes:
        return self.read1(size)


def _tail(data: bytes) -> str:
    return "\n".join(data.decode("utf-8", "replace").strip().splitlines()[-5:])


def _stream_tar(transport, staging: str, items: Sequence[Item], total: int, progress) -> None:
    """Step 2: the tar stream into ``staging`` (raises as the module docstring says)."""
    timeout = CHUNK_TIMEOUT + total / STREAM_RATE
    done = 0

    def sent(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(min(done, total), total)

    reader = _TarReader(items, sent)
    out, err = io.BytesIO(), io.BytesIO()
    start = time.monotonic()
    code = transport.stream(["tar", "-x", "-f", "-", "-C", staging, *TAR_ARGS], stdin=reader, stdout=out,
                            stderr=err, timeout=timeout)
    if reader.error is not None:
        raise reader.error
    if code == 124 or (code == 137 and time.monotonic() - start >= timeout):   # timeout(1)'s codes
        raise CommandTimeout(f"{transport.name}: sending {len(items)} files into {staging} timed out "
                             f"after {timeout:.0f} s")
    if code != 0:
        why = f"killed by signal {code - 128}" if code > 128 else _tail(err.getvalue()) or "no message"
        raise TransferError(f"{transport.name}: tar into {staging} failed (exit {code}): {why}")


def _verify(transport, staging: str, items: Sequence[Item], total: int) -> None:
    """Step 3: every staged file's sha256 equals the local one, else TransferError."""
    paths = [posixpath.join(staging, rel) for _, rel, _ in items]
    res = transport.run(["sha256sum", "--", *paths], timeout=hash_timeout(total), idempotent=True)
    lines = res.stdout.splitlines()
    if not res.ok or len(lines) != len(items):
        raise TransferError(f"{transport.name}: sha256sum of the staged files failed (exit {res.exit_code}): "
                            f"{_tail(res.stderr) or 'no message'}", res)
    bad = []
    for (_, rel, digest), line in zip(items, lines):
        try:
            got = parse_sha256sum(line)
        except ValueError as exc:
            raise TransferError(f"{transport.name}: {exc}", res) from None
        if got != digest:
            bad.append(f"{rel}: expected {digest}, destination has {got}")
    if bad:
        raise TransferError(f"{transport.name}: sha256 mismatch after sending {len(bad)} of {len(items)} files "
                            f"(nothing was placed): " + "; ".join(bad[:5]), res)


def _place_argvs(folder: str, staging: str, items: Sequence[Item]) -> list[list[str]]:
    """Step 4: ``mv -f -t <parent> -- <staged...>`` per final parent folder (pure)."""
    groups: dict[str, list[str]] = {}
    for _, rel, _ in items:
        parent = posixpath.dirname(rel)
        groups.setdefault(parent, []).append(posixpath.join(staging, rel))
    return [["mv", "-f", "-t", posixpath.join(folder, parent) if parent else folder, "--", *paths]
            for parent, paths in groups.items()]


def _remove(transport, staging: str) -> None:
    try:
        transport.run(["rm", "-rf", "--", staging], timeout=META_TIMEOUT, idempotent=True)
    except DdtctlError:
        pass           # the destination went away: the error in flight is the one to report


def _one_batch(transport, folder: str, items: Sequence[Item], total: int, progress) -> None:
    parents = sorted({posixpath.join(folder, posixpath.dirname(rel)) for _, rel, _ in items} - {folder})
    for attempt in range(WRITE_ATTEMPTS):
        staging = posixpath.join(folder, f"{STAGING}{uuid.uuid4().hex[:16]}")
        try:
            transport.run(["mkdir", "-p", "--", staging, *parents], timeout=META_TIMEOUT,
                          idempotent=True).check()
            _stream_tar(transport, staging, items, total, progress)
            _verify(transport, staging, items, total)
            for argv in _place_argvs(folder, staging, items):
                transport.run(argv, timeout=META_TIMEOUT).check()
        except UnreachableError:
            _remove(transport, staging)          # over the next connection, when there is one
            if attempt + 1 == WRITE_ATTEMPTS:
                raise
            continue                             # a fresh staging folder; placing is idempotent
        except BaseException:
            _remove(transport, staging)
            raise
        _remove(transport, staging)              # empty now; a leftover is harmless
        return


def push_many(transport, folder: str, items: Sequence[Item], *, progress: Progress | None = None) -> int:
    """Place ``items`` (local file, path relative to ``folder``, sha256) under the absolute
    ``folder`` of ``transport`` (see the module docstring); files are created mode 0644.
    ``progress(done, total)`` in bytes, called from the stream's stdin thread. Returns the bytes
    sent."""
    if not folder.startswith("/"):
        raise TransferError(f"{transport.name}: destination folder must be absolute: {folder!r}")
    for _, rel, _ in items:
        if rel.startswith("/") or ".." in rel.split("/") or not rel or rel.endswith("/"):
            raise TransferError(f"{transport.name}: not a relative file path: {rel!r}")
    sizes = [Path(local).stat().st_size for local, _, _ in items]
    total, done = sum(sizes), 0
    for group in batches(items, sizes):
        chosen, size = [items[i] for i in group], sum(sizes[i] for i in group)
        base = done

        def shifted(n: int, _t: int, base=base) -> None:
            if progress:
                progress(base + n, total)
        _one_batch(transport, folder, chosen, size, shifted)
        done += size
    return total


def remote_digests(transport, folder: str, rels: Sequence[str], total: int) -> dict[str, str]:
    """{relative path: sha256} of files under ``folder``: ONE ``sha256sum`` per ARGV_BYTES of
    paths; the files of a command that could not read one of them are left out (callers send
    what is left out)."""
    out: dict[str, str] = {}
    groups = batches([(Path(), r, "") for r in rels], [0] * len(rels))
    for group in groups:
        chosen = [rels[i] for i in group]
        res = transport.run(["sha256sum", "--", *(posixpath.join(folder, r) for r in chosen)],
                            timeout=hash_timeout(total), idempotent=True)
        lines = res.stdout.splitlines()
        if res.ok and len(lines) == len(chosen):
            try:
                out.update({rel: parse_sha256sum(line) for rel, line in zip(chosen, lines)})
            except ValueError:
                pass
    return out


def clean_stale(transport, folder: str, observed_paths) -> None:
    """Remove staging folders of dead runs under ``folder`` that are older than STALE_MINUTES,
    when ``observed_paths`` (relative paths seen there) shows any; one ``find`` command."""
    if not any(p.startswith(STAGING) for p in observed_paths):
        return
    transport.run(["find", folder, "-mindepth", "1", "-maxdepth", "1", "-type", "d", "-name", f"{STAGING}*",
                   "-mmin", f"+{STALE_MINUTES}", "-exec", "rm", "-rf", "--", "{}", "+"],
                  timeout=2 * META_TIMEOUT, idempotent=True)


def send_changed(transport, folder: str, items: Sequence[Item], check: Sequence[bool], *,
                 progress: Progress | None = None) -> list[int]:
    """Make each item's file under ``folder`` hold its content: items with ``check[i]`` (present
    on the target with the right size) are hashed there first, all in ONE ``sha256sum``, and
    skipped when equal; the rest go through :func:`push_many`. Returns the indexes sent."""
    ask = [i for i, c in enumerate(check) if c]
    have = remote_digests(transport, folder, [items[i][1] for i in ask],
                          sum(Path(items[i][0]).stat().st_size for i in ask))
    todo = [i for i, (_, rel, digest) in enumerate(items) if have.get(rel) != digest]
    if todo:
        push_many(transport, folder, [items[i] for i in todo], progress=progress)
    return todo
