"""The `release` and `current` steps of a router service: `sglang-router` in a verified release venv.

A router release is `<root>/releases/sglang-router-<version>-<sha12>/venv`, where sha12 hashes the
install settings (version, dependency mode, indexes, pip_args, base interpreter), so changing any
of them installs a new release beside the running one instead of modifying it. Dependencies come
from the host's `packages:` mode like the bundled server's (ops/packages.py): `index` (pip from an
index), `wheelhouse` (wheels downloaded here for the target's Python and platform, pushed, installed
with `--no-index`), `system` (a `--system-site-packages` venv over an interpreter that already has
sglang-router). Verified like a server release (ops/releases.py): the manifest matches the files,
the settings match, `import sglang_router.launch_router` (the Rust extension included) prints the
expected version, and every distribution sglang-router requires is present.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import time

from ddtctl.errors import CommandTimeout, RemoteError
from ddtctl.ops import packages, releases
from ddtctl.ops.packages import venv_python

DIST = "sglang-router"
CHECK = "import sglang_router.launch_router; from sglang_router.version import __version__; print(__version__)"


def requirement(host) -> str:
    return f"{DIST}=={host.service.version}"


def plan(host, python: str, wheelhouse_dir: str, wheel_names: list[str] | None = None) -> packages.InstallPlan:
    """venv options, pip installs and the settings fingerprint of the host's router release (pure)."""
    s, req = host.packages, requirement(host)
    fingerprint = {"dist": req, "mode": s.mode, "python": python,
                   **{k: v for k, v in s.to_dict().items() if k != "mode"}}
    if s.mode == "system":
        return packages.InstallPlan("system", ["--system-site-packages", "--without-pip"],   # see ops/packages.py
                                    [["--no-index", "--no-deps", *s.pip_args, req]], fingerprint)
    if s.mode == "wheelhouse":
        source = ["--no-index", "--find-links", wheelhouse_dir]
        if wheel_names is not None:
            fingerprint["wheels"] = sorted(wheel_names)
    else:
        source = packages.index_options(s)
    return packages.InstallPlan(s.mode, [], [[*source, *s.pip_args, req]], fingerprint)


def release_id(host, python: str) -> str:
    """`sglang-router-<version>-<sha12 of the install settings>` (wheel names excluded: known only
    after the wheelhouse is built)."""
    settings = {k: v for k, v in plan(host, python, "").fingerprint.items() if k != "wheels"}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return f"{DIST}-{host.service.version}-{digest}"


def verify(transport, layout: releases.Layout, rid: str, python: str, fingerprint: dict,
           version: str, *, written: dict | None = None) -> releases.Verification:
    """Check releases/<rid> as ops/releases.verify does for a server release (`written` too: the
    manifest `install` has just written, not listed and hashed a second time); never raises."""
    rel = layout.release(rid)
    venv_py = posixpath.join(rel, "venv", "bin", "python")
    if written is not None:
        doc = {"ok": True, "problems": [], "files": written["files"], "hashed": written["hashed"],
               "meta": {"fingerprint": written["fingerprint"]}}
    elif not transport.run(["test", "-d", rel], timeout=60).ok:
        return releases.Verification(False, "missing", ["not installed"])
    else:
        doc, why = releases.probe(transport, python, "check", rel, timeout=releases.PROBE_TIMEOUT_S)
        if doc is None:
            return releases.Verification(False, "manifest", [why])
    out = releases.Verification(False, "manifest", doc["problems"], doc["files"], doc["hashed"])
    if not doc["ok"]:
        return out
    installed = (doc.get("meta") or {}).get("fingerprint") or {}
    changed = [f"{k}: {installed.get(k)!r} -> {fingerprint[k]!r}" for k in sorted(fingerprint)
               if installed.get(k) != fingerprint[k]]
    if changed:
        out.stage, out.problems = "settings", ["installed with other settings: " + ", ".join(changed)]
        return out
    out.stage = "entry-point"
    try:
        res = transport.run([venv_py, "-c", CHECK], timeout=releases.ENTRY_POINT_TIMEOUT_S)
    except CommandTimeout:
        out.problems = [f"importing sglang_router did not finish within {releases.ENTRY_POINT_TIMEOUT_S} s"]
        return out
    if not res.ok or res.text.strip() != version:
        out.problems = [f"importing sglang_router exited {res.exit_code}: "
                        f"{(res.text + res.err_text).strip()[-300:] or 'no output'} (expected version {version})"]
        return out
    deps, why = releases.probe(transport, venv_py, "deps", DIST, timeout=releases.ENTRY_POINT_TIMEOUT_S)
    out.stage = "deps"
    if deps is None or not deps["ok"]:
        out.problems = [why] if deps is None else deps["problems"]
        return out
    out.ok, out.stage, out.dependencies = True, "", deps["checked"]
    return out


def install(transport, layout: releases.Layout, rid: str, python: str, p: packages.InstallPlan,
            version: str) -> releases.Verification:
    """venv + pip installs + manifest (last) + verify; a folder already there (it failed
    verification) is moved aside and put back when anything fails. Raises RemoteError."""
    rel, venv = layout.release(rid), posixpath.join(layout.release(rid), "venv")
    aside = posixpath.join(layout.root, f".ddtctl-reinstall-{rid}")
    transport.run(["rm", "-rf", "--", aside], timeout=300).check()
    had_old = transport.run(["test", "-d", rel], timeout=60).ok
    if had_old:
        transport.run(["mv", "-T", "--", rel, aside], timeout=60).check()
    pip = [posixpath.join(venv, "bin", "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    try:
        transport.run(["mkdir", "-p", "--", rel], timeout=60).check()
        releases.make_venv(transport, python, venv, p.venv_args)
        for args in p.pip_installs:
            transport.run([*pip, *args], timeout=releases.INSTALL_TIMEOUT_S).check()
        doc = {"version_id": rid, "fingerprint": p.fingerprint}
        written, why = releases.probe(transport, python, "write", rel, json.dumps(doc),
                                      timeout=releases.PROBE_TIMEOUT_S)
        if why:
            raise RemoteError(f"{transport.name}: writing the release manifest failed: {why}")
        check = verify(transport, layout, rid, python, p.fingerprint, version,
                       written={**written, "fingerprint": p.fingerprint})
        if not check.ok:
            raise RemoteError(f"{transport.name}: release {rid} installed but does not verify: {check.summary()}")
    except BaseException:
        transport.run(["rm", "-rf", "--", rel], timeout=300)
        if had_old:
            transport.run(["mv", "-T", "--", aside, rel], timeout=60)
        raise
    if had_old:
        transport.run(["rm", "-rf", "--", aside], timeout=300)
    return check


def router_release_step(host, transport, layout, old, run, dry_run, progress_factory) -> bool:
    """Verify (install when missing or broken) the router release and point `current` at it; True
    when `current` moved. Reports through the deploy's step log like ops/release_step.py."""
    python, t, version = venv_python(host), time.monotonic(), host.service.version
    rid = release_id(host, python)
    run.result.release = rid
    house = None
    if host.packages.mode == "wheelhouse" and not dry_run:
        facts = packages.target_facts(transport, python)
        house = packages.build_wheelhouse(host, None, facts, reqs=[requirement(host)])
    p = plan(host, python, layout.wheelhouse, house.names if house else None)
    check = verify(transport, layout, rid, python, p.fingerprint, version)
    how = f"{p.mode} mode, venv from {python}"
    if check.ok:
        run.step("release", "ok", f"{rid} already installed ({check.summary()})", t)
    elif dry_run:
        why = "" if check.stage == "missing" else f"; it failed verification: {check.summary()}"
        run.step("release", "planned", f"{'install' if not why else 'reinstall'} {rid} ({how}){why}")
    else:
        sent = ""
        if house is not None:
            wr = packages.push_wheelhouse(transport, house, layout.wheelhouse, progress_factory)
            sent = f"; wheelhouse {len(house.names)} wheels, {wr.files_sent} sent ({wr.bytes_sent} bytes)"
        after = install(transport, layout, rid, python, p, version)
        again = "" if check.stage == "missing" else f"re-installed, was {check.summary()}; "
        run.step("release", "changed", f"{again}installed {rid} ({how}{sent}; {after.summary()})", t)
        run.reinstalled = old == rid
    return releases.point_current(transport, layout, old, rid, run, dry_run)
