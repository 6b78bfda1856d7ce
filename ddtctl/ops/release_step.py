"""The `release` and `current` steps of a deploy (ddtree services): verify, (re)install, switch.

Kept apart from ops/deploy.py (which orders the steps and rolls back): the release is verified
before it is used (ops/releases.py), installed or reinstalled with the host's dependency mode
(ops/packages.py; wheelhouse mode builds and pushes the wheelhouse first), then `current` is
pointed at it. Reports through the deploy's step log.
"""

from __future__ import annotations

import posixpath
import sys
import time

from ddtctl.errors import UsageError
from ddtctl.inventory import Host
from ddtctl.ops import packages, releases


def venv_python(host: Host) -> str:
    """Interpreter the release venv is made from: inventory `python`, else ddtctl's own on local hosts."""
    return host.service.python or (sys.executable if host.kind == "local" else "python3")


def release_step(host, transport, layout, bundle, old, run, dry_run, progress_factory) -> bool:
    """Verify this checkout's release (install it when missing, reinstall it when it fails
    verification) and point `current` at it; True if `current` moved.

    `run`: the deploy's bookkeeping (`step(name, status, detail, since)`, `result.release`,
    `reinstalled` set when the current release was installed again in place)."""
    svc = host.service
    if svc.kind == "router":
        from ddtctl.ops.router_release import router_release_step
        return router_release_step(host, transport, layout, old, run, dry_run, progress_factory)
    if svc.kind != "ddtree":
        return False
    if bundle is None:
        raise UsageError("internal: deploying a ddtree service needs the server bundle")
    vid, t, python = bundle.version_id, time.monotonic(), venv_python(host)
    run.result.release = vid
    wheel = getattr(bundle, "wheel", None)
    wheel_name = wheel.name if wheel is not None else f"ddtree_server-{_version(bundle)}-py3-none-any.whl"
    house = None
    if host.packages.mode == "wheelhouse" and not dry_run:
        house = packages.build_wheelhouse(host, wheel, packages.target_facts(transport, python))
    plan = packages.install_plan(host, python, posixpath.join(layout.release(vid), wheel_name),
                                 wheelhouse_dir=layout.wheelhouse, wheel_names=house.names if house else None)
    check = releases.verify(transport, layout, vid, python, plan.fingerprint, _version(bundle))
    how = f"{plan.mode} mode, venv from {python}"
    if check.ok:
        run.step("release", "ok", f"{vid} already installed ({check.summary()})", t)
    elif dry_run:
        why = "" if check.stage == "missing" else f"; it failed verification: {check.summary()}"
        run.step("release", "planned", f"{'install' if not why else 'reinstall'} {vid} ({how}){why}")
    else:
        sent_wh = ""
        if house is not None:
            wr = packages.push_wheelhouse(transport, house, layout.wheelhouse, progress_factory)
            sent_wh = f"; wheelhouse {len(house.names)} wheels, {wr.files_sent} sent ({wr.bytes_sent} bytes)"
        cb = progress_factory(f"wheel {wheel.name}", wheel.stat().st_size) if progress_factory else None
        sent, after = releases.install(transport, layout, vid, wheel, python, plan, version=_version(bundle),
                                       progress=cb)
        again = "" if check.stage == "missing" else f"re-installed, was {check.summary()}; "
        run.step("release", "changed", f"{again}installed {vid} ({how}; {sent} wheel bytes sent{sent_wh}; "
                 f"{after.summary()})", t)
        run.reinstalled = old == vid
    if old == vid:
        return False
    if not dry_run:
        releases.switch(transport, layout, vid)
        run.result.current_release = vid
    run.step("current", "planned" if dry_run else "changed", f"{old or '(none)'} -> {vid}")
    return True


def _version(bundle) -> str:
    """The server version of a Bundle or SourceIdentity (what `ddtree-server --version` prints):
    the version id is `<version>-<sha12>`."""
    return bundle.version_id.rsplit("-", 1)[0]
