"""The server wheel of exactly this checkout, and its version identity.

Identity = the ddtree-server package version + sha256 of every source file under server/
(relative paths and contents; build debris, bytecode and hidden files excluded, as in the wheel build): `0.1.0-1a2b3c4d5e6f`. It names the
release directory on each host and is what `status` compares the deployed release against.
The wheel is built once per identity with `pip wheel --no-deps` and cached under
$DDTCTL_HOME/cache/wheels/<identity>/; the cache keeps the WHEEL_CACHE_KEEP most recently used
identities (a cache hit counts as a use) and deletes older ones at each call.
ddtctl never imports ddtree_server.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ddtctl.errors import UsageError
from ddtctl.inventory import ddtctl_home

WHEEL_CACHE_KEEP = 5
_SKIP_DIRS = {"__pycache__", "build", "dist", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo", ".egg-info")


@dataclass(frozen=True)
class SourceIdentity:
    """Version identity of a server source tree."""

    version: str
    sha256: str
    source_dir: Path

    @property
    def version_id(self) -> str:
        return f"{self.version}-{self.sha256[:12]}"


@dataclass(frozen=True)
class Bundle:
    """A built server wheel and the identity it was built from."""

    identity: SourceIdentity
    wheel: Path
    built: bool          # False when taken from the cache

    @property
    def version_id(self) -> str:
        return self.identity.version_id


def server_source_dir() -> Path:
    """server/ of this checkout, else the copy bundled in the ddtctl wheel (ddtctl/_bundle/server)."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package.parent / "server", package / "_bundle" / "server"):
        if (candidate / "pyproject.toml").is_file() and (candidate / "ddtree_server").is_dir():
            return candidate
    raise UsageError("ddtree-server sources not found (expected server/ next to ddtctl/ or ddtctl/_bundle/server)")


def _source_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(_SKIP_SUFFIXES)
                             and not d.startswith("."))
        # hidden files (editor swap files, .coverage, ...) are skipped like hidden dirs: the wheel
        # build copies the sources without them, so they must not change the identity either
        files += [Path(dirpath) / f for f in sorted(filenames)
                  if not f.endswith(_SKIP_SUFFIXES) and not f.startswith(".")]
    return files


def source_identity(root: Path | None = None) -> SourceIdentity:
    """Version + sha256 of the server sources at `root` (default: `server_source_dir()`)."""
    root = root or server_source_dir()
    init = (root / "ddtree_server" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', init, re.M)
    if not match:
        raise UsageError(f"{root}/ddtree_server/__init__.py has no __version__")
    digest = hashlib.sha256()
    for path in _source_files(root):
        rel = path.relative_to(root).as_posix()
        digest.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return SourceIdentity(match.group(1), digest.hexdigest(), root)


def build_wheel(identity: SourceIdentity | None = None, *, cache_dir: Path | None = None) -> Bundle:
    """The wheel for `identity` (default: this checkout), built with pip unless already cached.

    Raises UsageError with pip's output when the build fails.
    """
    identity = identity or source_identity()
    cache = (cache_dir or ddtctl_home() / "cache" / "wheels") / identity.version_id
    cached = sorted(cache.glob("ddtree_server-*.whl")) if cache.is_dir() else []
    if cached:
        os.utime(cache)                                  # most recently used: kept by the prune
        prune_cache(cache.parent, WHEEL_CACHE_KEEP)
        return Bundle(identity, cached[0], built=False)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ddtctl-wheel-", dir=cache.parent) as tmp:
        out = Path(tmp) / "out"
        argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out)]
        if importlib.util.find_spec("hatchling") is not None:
            argv.append("--no-build-isolation")          # no network needed at deploy time
        staged = Path(tmp) / "src"                       # build a clean copy: no debris, no writes to the checkout
        shutil.copytree(identity.source_dir, staged, ignore=shutil.ignore_patterns(*_SKIP_DIRS, "*.pyc", ".*"))
        proc = subprocess.run([*argv, str(staged)], capture_output=True, text=True, timeout=900)
        wheels = sorted(out.glob("ddtree_server-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise UsageError(f"building the ddtree-server wheel failed:\n{proc.stdout}{proc.stderr}".rstrip())
        staging = Path(tmp) / "final"
        staging.mkdir()
        shutil.move(str(wheels[0]), staging / wheels[0].name)
        try:
            staging.rename(cache)
        except OSError:                                  # a concurrent build won the race
            pass
    prune_cache(cache.parent, WHEEL_CACHE_KEEP)
    return Bundle(identity, sorted(cache.glob("ddtree_server-*.whl"))[0], built=True)


def prune_cache(cache_dir: Path, keep: int) -> list[str]:
    """Delete all but the `keep` most recently used entries (folders, by mtime) of `cache_dir`
    (builds in progress, `ddtctl-*`, are left alone); returns the deleted names."""
    entries = sorted((p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith("ddtctl-")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for path in entries[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in entries[keep:]]
