"""The sending half of the weights' manifest sync (ops/weights.py plans, this sends).

Files below SMALL_FILE (8 MiB) go together (remote/push_many.py): those present on the target
with their size are hashed there in ONE ``sha256sum`` and skipped when equal, the others travel
as one tar stream per batch into a staging folder, are verified with one ``sha256sum`` and put in
place with one ``mv`` per folder: a constant number of remote commands however many files (a
wheelhouse of ~50 small wheels). Larger files keep the resumable, chunked, per-file
``Transport.put``. The manifest is written last, the same way as the small files. A transport
without ``stream`` (none of ddtctl's) gets ``put`` for every file.
"""

from __future__ import annotations

import json
import os
import posixpath
import tempfile
from pathlib import Path

from ddtctl.remote.push import local_sha256
from ddtctl.remote.push_many import SMALL_FILE, clean_stale, push_many, send_changed


def send_files(transport, name: str, source: Path, dest: str, folder: str, manifest: dict[str, dict],
               send: list[str], rehash: list[str], observed: dict[str, list], result,
               progress_factory=None) -> int:
    """Send what `send` and `rehash` (relative paths of the manifest) need; adds to `result`
    (a WeightsResult: files/bytes sent, files re-hashed). Returns how many re-hashed files
    differed and were sent again."""
    todo = send + rehash
    single = source.is_file()
    batched, sent = _send_small(transport, name, source, dest, folder, manifest, todo, observed, progress_factory)
    result.files_sent += len(sent)
    result.bytes_sent += sum(manifest[r]["size"] for r in sent)
    result.files_rehashed += sum(r in rehash for r in batched)
    repaired = sum(r in rehash for r in sent)
    done = set(batched)
    for rel in (r for r in todo if r not in done):
        local_file = source if single else source / rel
        target = dest if single else posixpath.join(dest, rel)
        cb = progress_factory(f"{name}: {rel}", manifest[rel]["size"]) if progress_factory else None
        put = transport.put(local_file, target, mode=0o644, progress=cb)   # hashes first: skips an equal file
        result.files_sent += 0 if put.skipped else 1
        result.bytes_sent += put.bytes_sent
        result.files_rehashed += rel in rehash
        repaired += rel in rehash and not put.skipped
    return repaired


def _send_small(transport, name: str, source: Path, dest: str, folder: str, manifest: dict[str, dict],
                todo: list[str], observed: dict[str, list], progress_factory) -> tuple[list[str], list[str]]:
    """(the files of `todo` below SMALL_FILE, those of them that were sent)."""
    if not hasattr(transport, "stream"):
        return [], []
    if not source.is_file():
        clean_stale(transport, folder, observed)          # a dead run's staging folder
    small = [r for r in todo if manifest[r]["size"] < SMALL_FILE]
    single = source.is_file()
    items = [(source if single else source / r, posixpath.basename(dest) if single else r, manifest[r]["sha256"])
             for r in small]
    check = [(observed.get(r) or [None])[0] == manifest[r]["size"] for r in small]
    total = sum(manifest[r]["size"] for r in small)
    cb = progress_factory(f"{name}: {len(small)} files", total) if progress_factory and small else None
    sent = send_changed(transport, folder, items, check, progress=cb)
    return small, [small[i] for i in sent]


def write_manifest(transport, folder: str, manifest_path: str, doc: dict) -> None:
    """Write `doc` as JSON to `manifest_path` (a file directly in `folder`) on the target."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(doc, fh, indent=1, sort_keys=True)
    try:
        if hasattr(transport, "stream"):      # 5 commands instead of a put's 6 to 15
            push_many(transport, folder, [(Path(fh.name), posixpath.basename(manifest_path), local_sha256(fh.name))])
        else:
            transport.put(Path(fh.name), manifest_path, mode=0o644)
    finally:
        os.unlink(fh.name)
