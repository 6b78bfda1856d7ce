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


# ----------------------------------------------------------------------------- through a Transport

def read_link(transport, path: str) -> str | None:
    """The release id a link points to, or None when the link is missing."""
    res = transport.run(["readlink", path], timeout=60)
    return release_id_of(res.text) if res.ok else None


def switch(transport, layout: Layout, version_id: str, *, keep_previous: bool = True) -> str | None:
    """Point `current` at `version_id`; the old target becomes `previous`. Returns the old id."""
    old = read_link(transport, layout.current)
    if old == version_id:
        return old
    if old and keep_previous:
        for argv in switch_link_argvs(layout, layout.previous, old):
            transport.run(argv, timeout=60).check()
    for argv in switch_link_argvs(layout, layout.current, version_id):
        transport.run(argv, timeout=60).check()
    return old


def restore_previous(transport, layout: Layout, version_id: str | None) -> None:
    """Put the `previous` link back to `version_id` (None: remove it), e.g. after an automatic
    rollback, so that `previous` never ends up equal to `current`."""
    if version_id is None:
        transport.run(["rm", "-f", "--", layout.previous], timeout=60).check()
        return
    for argv in switch_link_argvs(layout, layout.previous, version_id):
        transport.run(argv, timeout=60).check()


def is_installed(transport, layout: Layout, version_id: str) -> bool:
    """True when releases/<id> finished installing (its `.complete` marker exists)."""
    marker = posixpath.join(layout.release(version_id), ".complete")
    return transport.run(["test", "-f", marker], timeout=60).ok


def install_argvs(layout: Layout, version_id: str, wheel_name: str, python: str,
                  venv_args: list[str], pip_args: list[str]) -> list[list[str]]:
    """venv + pip install of a pushed wheel, a smoke run of the console script, the marker (pure)."""
    rel = layout.release(version_id)
    venv = posixpath.join(rel, "venv")
    return [
        [python, "-m", "venv", *venv_args, venv],
        [posixpath.join(venv, "bin", "python"), "-m", "pip", "install", "--disable-pip-version-check",
         *pip_args, posixpath.join(rel, wheel_name)],
        [posixpath.join(venv, "bin", "ddtree-server"), "--version"],
        ["touch", posixpath.join(rel, ".complete")],
    ]


def install(transport, layout: Layout, version_id: str, wheel, python: str, venv_args: list[str],
            pip_args: list[str], progress=None) -> int:
    """Push the wheel into releases/<id>/ and install it in a fresh venv; returns wheel bytes sent.

    Raises RemoteError (with pip's output) when a step fails; a half-made release is removed.
    """
    rel = layout.release(version_id)
    transport.run(["rm", "-rf", "--", rel], timeout=300).check()
    transport.run(["mkdir", "-p", "--", rel], timeout=60).check()
    put = transport.put(wheel, posixpath.join(rel, wheel.name), mode=0o644, progress=progress)
    try:
        for argv in install_argvs(layout, version_id, wheel.name, python, venv_args, pip_args):
            transport.run(argv, timeout=1800).check()
    except Exception:
        transport.run(["rm", "-rf", "--", rel], timeout=300)
        raise
    return put.bytes_sent


def list_releases(transport, layout: Layout) -> list[Release]:
    """Releases on the host, newest first, with current/previous marked."""
    res = transport.run(list_argv(layout), timeout=60)
    return parse_releases(res.text if res.ok else "", read_link(transport, layout.current),
                          read_link(transport, layout.previous))


def prune(transport, layout: Layout, keep: int) -> list[str]:
    """Delete all but the `keep` newest releases (never current/previous); returns deleted ids."""
    doomed = prune_candidates(list_releases(transport, layout), keep)
    for rel in doomed:
        transport.run(["rm", "-rf", "--", layout.release(rel.version_id)], timeout=600).check()
    return [r.version_id for r in doomed]
