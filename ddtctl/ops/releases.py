"""Release directories behind a `current` symlink: layout, argv builders and listing parsers.

    <root>/releases/<version-id>/     wheel + venv of one server build (`.complete` once installed)
    <root>/current  -> releases/<id>  what the service runs (ExecStart goes through this link)
    <root>/previous -> releases/<id>  what `rollback` switches back to
    <root>/<unit-stem>.env            EnvironmentFile of the service

Everything here returns argv lists or parses command output; running them is the caller's job
(through a Transport), so the same code serves local hosts and containers.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Paths of one host's install root (POSIX paths on the target)."""

    root: str
    unit: str = "ddtree.service"

    @property
    def releases_dir(self) -> str:
        return posixpath.join(self.root, "releases")

    @property
    def current(self) -> str:
        return posixpath.join(self.root, "current")

    @property
    def previous(self) -> str:
        return posixpath.join(self.root, "previous")

    @property
    def env_file(self) -> str:
        return posixpath.join(self.root, self.unit.removesuffix(".service") + ".env")

    @property
    def server_bin(self) -> str:
        """The server console script of the current release."""
        return posixpath.join(self.current, "venv", "bin", "ddtree-server")

    def release(self, version_id: str) -> str:
        return posixpath.join(self.releases_dir, version_id)


def release_id_of(link_target: str) -> str | None:
    """The version id a `current`/`previous` link points to (`readlink` output), or None."""
    target = link_target.strip().rstrip("/")
    return posixpath.basename(target) if target else None


def switch_link_argvs(layout: Layout, link: str, version_id: str) -> list[list[str]]:
    """Atomically point `link` (a path) at releases/<version_id>: make a temp link, rename it over."""
    tmp = f"{link}.tmp"
    target = posixpath.join("releases", version_id)
    return [["ln", "-sfn", target, tmp], ["mv", "-T", tmp, link]]


def list_argv(layout: Layout) -> list[str]:
    """`find` printing `<mtime> <name>` for each release directory."""
    return ["find", layout.releases_dir, "-mindepth", "1", "-maxdepth", "1", "-type", "d",
            "-printf", "%T@ %f\\n"]


@dataclass(frozen=True)
class Release:
    """One release directory on a host."""

    version_id: str
    mtime: float
    current: bool = False
    previous: bool = False

    def to_dict(self) -> dict:
        return {"version_id": self.version_id, "mtime": self.mtime, "current": self.current,
                "previous": self.previous}


def parse_releases(find_output: str, current: str | None, previous: str | None) -> list[Release]:
    """Releases from `list_argv` output, newest first."""
    out = []
    for line in find_output.splitlines():
        stamp, _, name = line.strip().partition(" ")
        if not name:
            continue
        try:
            mtime = float(stamp)
        except ValueError:
            continue
        out.append(Release(name, mtime, name == current, name == previous))
    return sorted(out, key=lambda r: r.mtime, reverse=True)


def prune_candidates(releases: list[Release], keep: int) -> list[Release]:
    """Releases to delete: all but the `keep` newest; current and previous are always kept."""
    if keep < 1:
        raise ValueError("keep at least 1 release")
    newest = {r.version_id for r in sorted(releases, key=lambda r: r.mtime, reverse=True)[:keep]}
    return [r for r in releases if r.version_id not in newest and not (r.current or r.previous)]
