"""Deploy one host: release, weights, unit, restart-if-changed, wait-ready, smoke, rollback.

The same code path serves a local host (LocalTransport + local supervisor) and a container
(ContainerTransport + systemd): everything on the target goes through the Transport and the
service manager. Steps report ok / changed / planned / skipped / failed; the service is restarted
only when the release, the unit/env files or the weights changed (or it is not running). A failed
wait-ready or smoke after a release change switches `current` back and restarts the old release
under the rollback's own readiness deadline (ops/recovery.py).
`dry_run` gathers facts (links, file contents, manifests) and changes nothing.
"""

from __future__ import annotations

import difflib
import os
import posixpath
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from ddtctl import cancel
from ddtctl.errors import DdtctlError, RemoteError
from ddtctl.inventory import Host
from ddtctl.ops import logcause, recovery, releases, weights
from ddtctl.ops.lock import HostLocked, host_lock
from ddtctl.ops.readiness import ReadyReport, wait_ready
from ddtctl.ops.release_step import release_step
from ddtctl.ops.smoke import SmokeReport, require_ok, run_smoke
from ddtctl.ops.supervisor import manager_for
from ddtctl.ops.units import service_spec

API_KEY_VARS = {"ddtree": "DDTREE_API_KEY", "vllm": "VLLM_API_KEY"}


@dataclass
class Step:
    name: str
    status: str              # ok | changed | planned | skipped | failed
    detail: str = ""
    seconds: float = 0.0


@dataclass
class DeployResult:
    """Everything `ddtctl deploy` reports for one host (also its --json document)."""

    host: str
    dry_run: bool = False
    changed: bool = False
    restarted: bool = False
    release: str | None = None
    previous_release: str | None = None
    weights_bytes_sent: int = 0
    url: str = ""
    model_id: str = ""
    rolled_back: bool = False
    current_release: str | None = None   # what `current` points at when the deploy ends
    service: str = ""                    # the service's state after a rollback, in words
    steps: list[Step] = field(default_factory=list)
    diffs: dict[str, str] = field(default_factory=dict)
    ready: ReadyReport | None = None
    smoke: SmokeReport | None = None
    error: DdtctlError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict:
        return {"host": self.host, "ok": self.ok, "dry_run": self.dry_run, "changed": self.changed,
                "restarted": self.restarted, "release": self.release, "previous_release": self.previous_release,
                "weights_bytes_sent": self.weights_bytes_sent, "url": self.url, "model_id": self.model_id,
                "rolled_back": self.rolled_back, "current_release": self.current_release,
                "service": self.service or None, "steps": [s.__dict__ for s in self.steps], "diffs": self.diffs,
                "ready": self.ready.to_dict() if self.ready else None,
                "smoke": self.smoke.to_dict() if self.smoke else None,
                "error": str(self.error) if self.error else None,
                "exit_code": int(self.error.exit_code) if self.error else 0}


class _Run:
    """Bookkeeping for one deploy: timed steps appended to the result, plus a log callback."""

    def __init__(self, result: DeployResult, log: Callable[[str, Step], None] | None):
        self.result, self.log = result, log
        self.replaced: dict[str, tuple[str, int]] = {}     # path -> (previous text, mode) of rewritten files
        self.verify = False                               # re-hash every weight file (deploy --verify)

    def step(self, name: str, status: str, detail: str = "", since: float | None = None) -> Step:
        step = Step(name, status, detail, round(time.monotonic() - since, 2) if since else 0.0)
        self.result.steps.append(step)
        if self.log:
            self.log(self.result.host, step)
        return step


def deploy_host(host: Host, transport, *, bundle=None, node_transport=None, dry_run: bool = False,
                smoke: bool = True, timeout_s: float | None = None, progress_factory=None,
                log: Callable[[str, Step], None] | None = None, break_lock: bool = False,
                rollback_timeout_s: float | None = None, verify: bool = False) -> DeployResult:
    """Deploy `host`; never raises for a host failure (see `DeployResult.error`).

    `verify`: re-hash every weight file on the target (`deploy --verify`), not only those whose
    size, mtime or inode changed since the last push. `timeout_s`: the new release's wait-ready deadline; `rollback_timeout_s`: the rollback's own
    (default: the service's ready_timeout_s; see ops/recovery.py).

    `bundle`: a built Bundle (ddtree services; for dry runs a SourceIdentity is enough).
    `node_transport`: the Proxmox node's transport (needed for `weights: shared`).
    A real deploy holds the host lock (ops/lock.py) throughout; `break_lock` removes a stale one.
    """
    result = DeployResult(host.name, dry_run=dry_run, model_id=host.model_id, url=host.url)
    run = _Run(result, log)
    run.verify = verify
    try:
        lock = nullcontext() if dry_run else host_lock(transport, host.root, "deploy", break_lock=break_lock,
                                                       note=lambda text: run.step("lock", "changed", text))
        with lock:
            _apply(host, transport, node_transport, bundle, run, dry_run, smoke, timeout_s, progress_factory,
                   recovery.rollback_timeout(host, rollback_timeout_s))
    except DdtctlError as exc:
        result.error = exc
        if not any(s.status == "failed" for s in result.steps):
            run.step("lock" if isinstance(exc, HostLocked) else "error", "failed", str(exc).splitlines()[0])
    return result


def _apply(host, transport, node_transport, bundle, run: _Run, dry_run, smoke, timeout_s, progress_factory,
           rollback_timeout_s: float):
    res = run.result
    layout = releases.Layout(host.root, host.unit)
    manager = manager_for(host, transport)
    old = res.previous_release = res.current_release = releases.read_link(transport, layout.current)
    old_previous = releases.read_link(transport, layout.previous)
    cancel.check("the release step")
    release_changed = release_step(host, transport, layout, bundle, old, run, dry_run, progress_factory,
                                   old_previous)
    try:
        cancel.check("the weights")
        weights_changed = _weights(host, transport, node_transport, run, dry_run, progress_factory)
        cancel.check("the unit files")
        unit_changed = _unit_files(host, transport, manager, run, dry_run)
        res.changed = release_changed or unit_changed or weights_changed
        if dry_run:
            run.step("restart", "planned" if res.changed else "skipped",
                     "would restart" if res.changed else "nothing changed: no restart")
            return
        cancel.check("the restart")
        _restart_and_check(host, transport, manager, run, smoke, timeout_s)
    except Exception as exc:              # any failure, a Ctrl-C (Interrupted) or a broken pipe alike
        if not dry_run and ((release_changed and old) or run.replaced):
            with cancel.shielded():           # the rollback itself is not interrupted by Ctrl-C
                rolled_back = _rollback(host, transport, manager, layout, old if release_changed else None, run,
                                        rollback_timeout_s, old_previous)
            if not rolled_back:
                raise recovery.RecoveryFailed(f"{exc}\nrollback failed: {run.result.steps[-1].detail}",
                                              getattr(exc, "exit_code", 1)) from exc
        raise


def _restart_and_check(host, transport, manager, run: _Run, smoke: bool, timeout_s) -> None:
    """Restart only if something changed (start if not running), then wait-ready and smoke."""
    res = run.result
    t, state = time.monotonic(), manager.state()
    if res.changed or state.active not in ("active", "activating", "reloading"):
        res.restarted = True              # also when the start job fails: the unit did change state
        try:
            manager.restart() if res.changed else manager.start()
        except RemoteError as exc:        # e.g. a Type=notify unit that died before READY=1
            why = logcause.cause(logcause.last_start(manager.log_tail(80)))
            run.step("restart", "failed", str(exc).splitlines()[0] + (f": {why}" if why else ""), t)
            raise RemoteError(f"{exc}\n{logcause.explain(manager.log_tail(80))}", exc.result) from exc
        run.step("restart", "changed", ("restarted" if res.changed else f"started (was {state.active})"), t)
    else:
        run.step("restart", "ok", "nothing changed: not restarted")
    t, name = time.monotonic(), "wait-ready"
    try:
        res.ready = wait_ready(host, transport, manager, timeout_s=timeout_s)
        run.step("wait-ready", "ok", f"ready in {res.ready.seconds:.1f} s", t)
        if smoke:
            t, name = time.monotonic(), "smoke"
            res.smoke = run_smoke(host, transport)
            require_ok(res.smoke)
            passed = sum(c.status == "pass" for c in res.smoke.checks)
            run.step("smoke", "ok", f"{passed}/{len(res.smoke.checks)} passed", t)
    except DdtctlError as exc:
        run.step(name, "failed", str(exc).splitlines()[0], t)
        raise


def _rollback(host, transport, manager, layout, old: str | None, run: _Run, timeout_s: float,
              old_previous: str | None = None) -> bool:
    """Put back the previous release (and the `previous` link as it was before this deploy) and
    the previous unit/env files, restart (reset-failed first), wait until ready under the
    rollback's own deadline `timeout_s`. When the service does not come back the links stay
    restored and the step says what state the service is in. True when the rollback worked."""
    t = time.monotonic()
    what = ([f"release {old}"] if old else []) + (["previous unit files"] if run.replaced else [])
    try:
        if old:
            releases.switch(transport, layout, old, keep_previous=False)
            releases.restore_previous(transport, layout, old_previous)
            run.result.current_release = old
        for path, (text, mode) in run.replaced.items():
            _write(transport, path, text, mode)
        if run.replaced:
            manager.activate()
        host = recovery.restored_host(host, _installed(transport, manager, host))
        run.result.url, run.result.model_id = host.url, host.model_id     # where it serves again
        if not run.result.restarted:              # failed before the restart: nothing else to undo
            run.result.rolled_back = True
            run.step("rollback", "changed", f"restored {' and '.join(what)} (service not restarted)", t)
            return True
        ready = recovery.restart_until_ready(host, transport, manager, timeout_s)
        run.result.rolled_back = True
        run.result.service = recovery.service_line(manager)
        run.step("rollback", "changed", f"back on {' and '.join(what)} (ready in {ready.seconds:.1f} s)", t)
        return True
    except DdtctlError as exc:
        run.result.rolled_back = True
        run.result.service = recovery.service_line(manager)
        run.step("rollback", "failed", f"restored {' and '.join(what)}, but the service did not come back "
                 f"({recovery.first_line(exc)}); service: {run.result.service}", t)
        return False


def _weights(host, transport, node_transport, run: _Run, dry_run, progress_factory) -> bool:
    changed = False
    for name, ref in (("target", host.service.target), ("drafter", host.service.drafter)):
        if ref is None:
            continue
        t = time.monotonic()
        try:
            wr = weights.sync_service_model(host, name, ref, transport, node_transport, dry_run=dry_run,
                                            progress_factory=progress_factory, verify=run.verify)
        except DdtctlError as exc:
            run.step(f"weights:{name}", "failed", str(exc).splitlines()[0], t)
            raise
        run.result.weights_bytes_sent += 0 if dry_run else wr.bytes_sent
        changed |= wr.changed
        status = ("planned" if dry_run else "changed") if wr.changed else "ok"
        detail = (f"{wr.dest}: {wr.files_sent}/{wr.files_total} files, {wr.bytes_sent} bytes sent"
                  if wr.files_total else f"{wr.dest} present") + (f"; mount {wr.mount}" if wr.mount else "")
        run.step(f"weights:{name}", status, detail + "".join(f"; {n}" for n in wr.notes), t)
    return changed


def _unit_files(host, transport, manager, run: _Run, dry_run) -> bool:
    spec = service_spec(host)
    key_var, key_env = API_KEY_VARS.get(host.service.kind), host.service.api_key_env
    secret = bool(key_var and key_env and os.environ.get(key_env))
    if secret:
        spec.env_file_vars[key_var] = os.environ[key_env]
    changed, t = False, time.monotonic()
    for path, (text, mode) in manager.unit_files(spec).items():
        res = transport.run(["cat", "--", path], timeout=60)
        current = res.text if res.ok else None
        if current == text:
            continue
        changed = True
        shown = "(holds the API key: diff hidden)" if secret and mode == 0o600 else None
        run.result.diffs[path] = shown or "".join(difflib.unified_diff(
            (current or "").splitlines(True), text.splitlines(True), f"{path} (installed)", f"{path} (rendered)"))
        if not dry_run:
            if current is not None:
                run.replaced[path] = (current, mode)
            _write(transport, path, text, mode)
    if not changed:
        run.step("unit", "ok", "unit and environment unchanged", t)
        return False
    if dry_run:
        run.step("unit", "planned", f"would write {', '.join(run.result.diffs)}", t)
        return True
    verdict = manager.verify()
    manager.activate()
    run.step("unit", "changed", f"written ({manager.kind}; verify {verdict})", t)
    return True


def _installed(transport, manager, host) -> dict[str, tuple[str, int]]:
    """The unit/env files installed now (after a rollback: the restored ones, or those it left)."""
    out = {}
    for path, (_text, mode) in manager.unit_files(service_spec(host)).items():
        res = transport.run(["cat", "--", path], timeout=60)
        if res.ok:
            out[path] = (res.text, mode)
    return out


def _write(transport, path: str, text: str, mode: int) -> None:
    transport.run(["mkdir", "-p", "--", posixpath.dirname(path)], timeout=60).check()
    with tempfile.NamedTemporaryFile("w", delete=False, suffix=".ddtctl") as fh:
        fh.write(text)
    try:
        transport.put(Path(fh.name), path, mode=mode)
    finally:
        os.unlink(fh.name)
