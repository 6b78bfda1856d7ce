"""The `release` and `current` steps of a deploy (ddtree services): verify, (re)install, switch.

Kept apart from ops/deploy.py (which orders the steps and rolls back): the release is verified
before it is used (ops/releases.py), installed or reinstalled with the host's dependency mode
(ops/packages.py; wheelhouse mode builds and pushes the wheelhouse first), then `current` is
pointed at it. Reports through the deploy's step log.
"""

from __future__ import annotations

import posixpath
import time

from ddtctl.errors import DdtctlError, UsageError
from ddtctl.ops import packages, releases
from ddtctl.ops.packages import venv_python


def release_step(host, transport, layout, bundle, old, run, dry_run, progress_factory, old_previous=None) -> bool:
    """Find or install the release of this checkout and these dependency settings, and point
    `current` at it; True if `current` moved.

    Releases are immutable (ops/releases.py): the id is `<version-id>+<deps>`; a release that
    verifies is used as it is (the current one first when it is this release or a fresh install
    of it, then `<id>`, then its fresh installs `<id>.rN`, newest first); otherwise it is installed into a folder no link points at: `<id>`, or `<id>.rN` when
    `current` or `previous` (`old`, `old_previous`) points at the broken `<id>`. So a deploy never
    modifies the release the service runs, and a failed deploy can always switch back to it.

    `run`: the deploy's bookkeeping (`step(name, status, detail, since)`, `result.release`)."""
    svc = host.service
    if svc.kind == "router":
        from ddtctl.ops.router_release import router_release_step
        return router_release_step(host, transport, layout, old, run, dry_run, progress_factory)
    if svc.kind != "ddtree":
        return False
    if bundle is None:
        raise UsageError("internal: deploying a ddtree service needs the server bundle")
    vid, t, python = bundle.version_id, time.monotonic(), venv_python(host)
    wheel = getattr(bundle, "wheel", None)
    wheel_name = wheel.name if wheel is not None else f"ddtree_server-{_version(bundle)}-py3-none-any.whl"
    house = None
    if host.packages.mode == "wheelhouse" and not dry_run:
        house = packages.build_wheelhouse(host, wheel, packages.target_facts(transport, python))

    def plan_for(rid: str):
        return packages.install_plan(host, python, posixpath.join(layout.release(rid), wheel_name),
                                     wheelhouse_dir=layout.wheelhouse, wheel_names=house.names if house else None)

    base = releases.release_id(vid, plan_for(vid).fingerprint)
    listed = [r.version_id for r in releases.list_releases(transport, layout)]   # newest first
    tried = [old] if releases.same_release(old, base) else []
    tried += [name for name in (base, *listed) if releases.same_release(name, base) and name not in tried]
    checks = {}
    for rid in tried:
        checks[rid] = releases.verify(transport, layout, rid, python, plan_for(rid).fingerprint, _version(bundle))
        if checks[rid].ok:
            run.result.release = rid
            run.step("release", "ok", f"{rid} already installed ({checks[rid].summary()})", t)
            return releases.point_current(transport, layout, old, rid, run, dry_run)
    check = checks[base]
    rid = base
    if base in (old, old_previous) and check.stage != "missing":   # never touch a linked release
        rid = releases.repair_id(base, listed)
    run.result.release = rid
    plan = plan_for(rid)
    how = f"{plan.mode} mode, venv from {python}"
    why = "" if check.stage == "missing" else f"{base} failed verification: {_bounded(check.summary())}"
    if dry_run:
        run.step("release", "planned", f"install {rid} ({how})" + (f"; {why}" if why else ""))
    else:
        sent_wh = ""
        if house is not None:
            wr = packages.push_wheelhouse(transport, house, layout.wheelhouse, progress_factory)
            sent_wh = f"; wheelhouse {len(house.names)} wheels, {wr.files_sent} sent ({wr.bytes_sent} bytes)"
        cb = progress_factory(f"wheel {wheel.name}", wheel.stat().st_size) if progress_factory else None
        try:
            sent, after = releases.install(transport, layout, rid, wheel, python, plan, version=_version(bundle),
                                           progress=cb)
        except DdtctlError as exc:           # e.g. pip: the first line says what ran, the last why
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            last = f" ({_bounded(lines[-1], 200)})" if len(lines) > 1 else ""
            run.step("release", "failed", f"installing {rid}: {_bounded(lines[0] if lines else '')}{last}", t)
            raise
        run.step("release", "changed", (f"{why}; " if why else "") + f"installed {rid} ({how}; {sent} wheel "
                 f"bytes sent{sent_wh}; {after.summary()})", t)
    return releases.point_current(transport, layout, old, rid, run, dry_run)


def _bounded(text: str, limit: int = 300) -> str:
    """One line of at most `limit` characters (a verification summary can list long paths)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _version(bundle) -> str:
    """The server version of a Bundle or SourceIdentity (what `ddtree-server --version` prints):
    the version id is `<version>-<sha12>`."""
    return bundle.version_id.rsplit("-", 1)[0]
