"""The local host end to end, on real processes and files (no mocks).

Fast: the local process supervisor on real child processes; weight manifests, release links and
release verification (manifest, settings, entry point, dependencies) through the real
LocalTransport. Slow (`-m slow`): `ddtctl deploy local` as a user runs it: real wheel build, venv,
the real ddtree-server with the embedded SmolLM2, wait-ready, smoke; a second deploy changes
nothing; a tampered file is seen; a deleted venv is reinstalled and restarted; a broken deploy
rolls back; stop.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddtctl.ops import releases
from ddtctl.ops.supervisor import LocalSupervisor
from ddtctl.ops.units import ServiceSpec, render_local
from ddtctl.errors import UsageError
from ddtctl.ops.weights import mount_plan, parse_mounts, shared_node_path, sync_model
from ddtctl.remote.transport import LocalTransport


def _install(sup: LocalSupervisor, tmp: Path, code: str, env: dict | None = None) -> None:
    spec = ServiceSpec(unit="t.service", kind="ddtree", description="test", argv=[sys.executable, "-c", code],
                       environment=env or {}, env_file=str(tmp / "t.env"), env_file_vars={"FROM_FILE": "x y"},
                       working_dir=str(tmp))
    sup.activate()
    sup.spec_file.write_text(render_local(spec))


def _wait(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def test_supervisor_start_logs_stop_with_sigkill_fallback(tmp_path: Path) -> None:
    sup = LocalSupervisor(tmp_path / "sv", stop_timeout_s=1.0)
    assert sup.state().active == "inactive"
    _install(sup, tmp_path, "import os, signal, time\n"
                            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                            "print('env', os.environ['A'], os.environ['FROM_FILE'], os.getcwd(), flush=True)\n"
                            "time.sleep(600)\n", env={"A": "1"})
    sup.start()
    state = sup.state()
    assert state.active == "active" and state.pid
    assert os.getpgid(state.pid) == state.pid                    # its own session / process group
    _wait(lambda: "env 1 x y" in sup.logs(5))
    assert f"env 1 x y {tmp_path}" in sup.logs(5)
    sup.start()                                                  # already running: no second process
    assert sup.state().pid == state.pid
    started = time.monotonic()
    sup.stop()                                                   # SIGTERM ignored -> SIGKILL after 1 s
    assert 0.9 < time.monotonic() - started < 15
    assert sup.state().active == "inactive"
    assert not Path(f"/proc/{state.pid}").exists() or "Z" in Path(f"/proc/{state.pid}/stat").read_text().split()[2]


def test_supervisor_reports_a_crash_as_failed(tmp_path: Path) -> None:
    sup = LocalSupervisor(tmp_path / "sv")
    _install(sup, tmp_path, "import sys; print('boom', flush=True); sys.exit(3)")
    sup.start()
    _wait(lambda: sup.state().active == "failed")
    state = sup.state()
    assert (state.active, state.result, state.failed) == ("failed", "exit-code", True)
    assert "boom" in sup.logs(3)
    assert json.loads(sup.state_file.read_text())["exit_code"] == 3


def test_supervisor_does_not_trust_a_reused_pid(tmp_path: Path) -> None:
    sup = LocalSupervisor(tmp_path / "sv")
    sup.activate()
    sup.state_file.write_text(json.dumps({"pid": os.getpid(), "desired": "running", "start_time": "1"}))
    assert sup.state().active == "failed"                        # our pid, but not the process it started


def test_weights_manifest_sends_only_changes(tmp_path: Path) -> None:
    src, dest = tmp_path / "model", tmp_path / "dest" / "model"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "sub" / "model.safetensors").write_bytes(os.urandom(300_000))
    (src / ".cache").mkdir()
    (src / ".cache" / "lock").write_text("ignored")
    t = LocalTransport()
    first = sync_model(t, "target", src, str(dest))
    assert (first.files_sent, first.files_total, first.bytes_sent) == (2, 2, 300_008)
    assert (dest / "sub" / "model.safetensors").read_bytes() == (src / "sub" / "model.safetensors").read_bytes()
    assert not (dest / ".cache").exists() and (dest / ".ddtctl-manifest.json").is_file()
    again = sync_model(t, "target", src, str(dest))
    assert (again.files_sent, again.bytes_sent, again.changed) == (0, 0, False)
    (src / "config.json").write_text('{"a": 2}')
    (dest / "sub" / "model.safetensors").unlink()                # lost on the target: resent
    third = sync_model(t, "target", src, str(dest))
    assert third.files_sent == 2 and third.bytes_sent == 300_008
    dry = sync_model(t, "target", src, str(dest), dry_run=True)
    assert dry.files_sent == 0


def test_weights_single_file(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(1000))
    dest = tmp_path / "on-target" / "model.gguf"
    t = LocalTransport()
    assert sync_model(t, "target", gguf, str(dest)).bytes_sent == 1004
    assert sync_model(t, "target", gguf, str(dest)).bytes_sent == 0
    assert dest.read_bytes() == gguf.read_bytes()


def test_shared_weights_bind_mount_plan() -> None:
    config = ("arch: amd64\nhostname: ct200\nmp0: /srv/ddtctl/models/Qwen3,mp=/models/Qwen3,ro=1\n"
              "mp2: local-lvm:vm-200-disk-1,mp=/data,size=8G\nrootfs: local-lvm:vm-200-disk-0,size=64G\n")
    mounts = parse_mounts(config)
    assert mounts[0] == {"volume": "/srv/ddtctl/models/Qwen3", "mp": "/models/Qwen3", "ro": "1"}
    assert shared_node_path("/srv/ddtctl/models", "/models/Qwen3/") == "/srv/ddtctl/models/Qwen3"
    assert mount_plan(mounts, "/srv/ddtctl/models/Qwen3", "/models/Qwen3") is None          # already there
    assert mount_plan(mounts, "/srv/ddtctl/models/D", "/models/D") == ["-mp1", "/srv/ddtctl/models/D,mp=/models/D,ro=1"]
    with pytest.raises(UsageError, match="mp2 already mounts local-lvm:vm-200-disk-1 at /data"):
        mount_plan(mounts, "/srv/ddtctl/models/x", "/data")


def test_release_links_list_and_prune(tmp_path: Path) -> None:
    t = LocalTransport()
    layout = releases.Layout(str(tmp_path), "ddtree.service")
    for i, vid in enumerate(["0.1.0-a", "0.1.0-b", "0.1.0-c", "0.1.0-d"]):
        (tmp_path / "releases" / vid).mkdir(parents=True)
        os.utime(tmp_path / "releases" / vid, (1000 + i, 1000 + i))
    assert releases.switch(t, layout, "0.1.0-a") is None
    assert releases.switch(t, layout, "0.1.0-b") == "0.1.0-a"
    assert os.readlink(tmp_path / "current") == "releases/0.1.0-b"
    assert releases.read_link(t, layout.previous) == "0.1.0-a"
    listed = releases.list_releases(t, layout)
    assert [(r.version_id, r.current, r.previous) for r in listed] == [
        ("0.1.0-d", False, False), ("0.1.0-c", False, False), ("0.1.0-b", True, False), ("0.1.0-a", False, True)]
    assert releases.prune(t, layout, 1) == ["0.1.0-c"]           # newest kept, current/previous always kept
    assert sorted(p.name for p in (tmp_path / "releases").iterdir()) == ["0.1.0-a", "0.1.0-b", "0.1.0-d"]


# ----------------------------------------------------------------------------- release verification

def _stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A local host, a verified stub release of it (tests/ctl/release_stub.py), and verify()."""
    from ddtctl.inventory import parse_inventory
    from ddtctl.ops import packages
    from ddtctl.ops.release_step import venv_python
    from tests.ctl.release_stub import stub_release

    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    host = parse_inventory("local:\n  h: {service: {kind: ddtree, port: 18990}}\n", tmp_path / "i.yaml").hosts["h"]
    rel = stub_release(host, "0.1.0-abc")
    (rel / "venv" / "lib").mkdir()
    (rel / "venv" / "lib" / "libbig.so").write_bytes(os.urandom(3 << 20))     # above the hash limit
    (rel / "venv" / "lib64").symlink_to("lib")
    fingerprint = packages.install_plan(host, venv_python(host), "x.whl").fingerprint
    from ddtctl.ops import release_probe
    release_probe.write(str(rel), json.dumps({"version_id": "0.1.0-abc", "fingerprint": fingerprint}))
    layout = releases.Layout(host.root, host.unit)

    def verify(fp=fingerprint, version="0.1.0"):
        return releases.verify(LocalTransport(), layout, "0.1.0-abc", venv_python(host), fp, version)
    return rel, verify


def test_an_intact_release_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rel, verify = _stub(tmp_path, monkeypatch)
    check = verify()
    assert check.ok, check
    assert check.files == 4 and check.hashed == 1 and check.dependencies > 10     # script, python link, lib64, big
    assert check.summary().startswith("verified: 4 files (1 hashed), entry point ok")


@pytest.mark.parametrize(("damage", "stage", "problem"), [
    ("edit", "manifest", "venv/bin/ddtree-server: sha256 differs"),
    ("delete-venv", "manifest", "venv/bin/ddtree-server: missing"),
    ("extra", "manifest", "venv/bin/evil.pth: not in the manifest"),
    ("relink", "manifest", "venv/lib64: symlink changed"),
    ("big-size", "manifest", "venv/lib/libbig.so: size"),
    ("big-mtime", "manifest", "venv/lib/libbig.so: modified (mtime)"),
    ("no-manifest", "manifest", "no manifest .ddtctl-release.json"),
])
def test_a_damaged_release_fails_verification(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str,
                                              stage: str, problem: str) -> None:
    rel, verify = _stub(tmp_path, monkeypatch)
    script, big = rel / "venv" / "bin" / "ddtree-server", rel / "venv" / "lib" / "libbig.so"
    if damage == "edit":                     # same size, same mtime: only the hash tells
        st = script.stat()
        script.write_text(script.read_text().replace("exit 0", "exit 7"))
        os.utime(script, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif damage == "delete-venv":
        shutil.rmtree(rel / "venv")
    elif damage == "extra":
        (rel / "venv" / "bin" / "evil.pth").write_text("import os\n")
    elif damage == "relink":
        (rel / "venv" / "lib64").unlink()
        (rel / "venv" / "lib64").symlink_to("/usr/lib")
    elif damage == "big-size":
        with open(big, "ab") as fh:
            fh.write(b"x")
    elif damage == "big-mtime":
        os.utime(big, ns=(1, 1))
    else:
        (rel / ".ddtctl-release.json").unlink()
        (rel / ".complete").touch()          # what ddtctl before verification trusted
    check = verify()
    assert (check.ok, check.stage) == (False, stage) and any(p.startswith(problem) for p in check.problems), check


def test_large_files_are_checked_by_size_and_mtime_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented limit: a file above 1 MiB changed in place with size and mtime kept. The
    manifest holds no hash of it (none is compared), and `write` counts what `check` counts."""
    from ddtctl.ops import release_probe

    rel, verify = _stub(tmp_path, monkeypatch)
    files = json.loads((rel / ".ddtctl-release.json").read_text())["files"]
    script = files["venv/bin/ddtree-server"]
    assert files["venv/lib/libbig.so"][2] is None and len(script[2]) == 64 and files["venv/lib64"] == ["link", "lib"]
    meta = json.loads((rel / ".ddtctl-release.json").read_text())
    del meta["files"]
    written = release_probe.write(str(rel), json.dumps(meta))
    checked = release_probe.check(str(rel))
    assert checked["ok"] and (written["files"], written["hashed"]) == (checked["files"], checked["hashed"]) == (4, 1)
    big = rel / "venv" / "lib" / "libbig.so"
    st = big.stat()
    with open(big, "r+b") as fh:
        fh.write(b"\0" * 16)
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert verify().ok


def test_a_failed_reinstall_puts_the_release_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reinstalling a release (here: one installed with other settings) that then fails to
    install leaves the folder exactly as it was, still verifying with its own settings."""
    from ddtctl.errors import RemoteError
    from ddtctl.ops import packages

    rel, verify = _stub(tmp_path, monkeypatch)
    before = sorted(str(p.relative_to(rel)) for p in rel.rglob("*"))
    layout = releases.Layout(str(rel.parents[1]), "ddtree.service")
    broken = tmp_path / "ddtree_server-0.1.0-py3-none-any.whl"
    broken.write_bytes(b"not a zip")
    # a venv over this interpreter, which lends its pip (no ensurepip: ~5 s of CPU for nothing
    # this test asserts); the install that fails is the pip install of the broken wheel
    plan = packages.InstallPlan("index", ["--system-site-packages", "--without-pip"],
                                [["--no-index", "--no-deps", str(rel / broken.name)]], {"mode": "index"})
    with pytest.raises(RemoteError, match="exit code"):
        releases.install(LocalTransport(), layout, "0.1.0-abc", broken, sys.executable, plan, version="0.1.0")
    assert sorted(str(p.relative_to(rel)) for p in rel.rglob("*")) == before
    assert verify().ok and not any(p.name.startswith(".ddtctl-reinstall") for p in rel.parents[1].iterdir())


def test_other_settings_a_broken_entry_point_and_missing_dependencies_fail(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from ddtctl.ops import release_probe

    rel, verify = _stub(tmp_path, monkeypatch)
    fp = json.loads((rel / ".ddtctl-release.json").read_text())["fingerprint"]
    other = verify(fp={**fp, "mode": "index", "index_url": "http://127.0.0.1:9/simple/"})
    assert other.stage == "settings" and "index_url: None -> 'http://127.0.0.1:9/simple/'" in other.problems[0]
    assert "mode: 'system' -> 'index'" in other.problems[0]
    wrong = verify(version="9.9.9")
    assert wrong.stage == "entry-point" and "expected 'ddtree-server 9.9.9'" in wrong.problems[0]
    # the dependency check, on a distribution that needs one that is not installed
    site = tmp_path / "site"
    info = site / "needy-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: needy\nVersion: 1.0\n"
                                   "Requires-Dist: numpy\nRequires-Dist: no-such-dist-xyz>=1\n"
                                   "Requires-Dist: other-xyz; extra == \"bench\"\n")
    out = subprocess.run([sys.executable, "-c", release_probe.source(), "deps", "needy"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(site)}, timeout=60)
    doc = json.loads(out.stdout)
    assert doc["ok"] is False and doc["problems"] == ["no-such-dist-xyz (needed by needy): not installed"]


@pytest.fixture(scope="session")
def wheel_cache(tmp_path_factory) -> Path:
    """One server-wheel cache ($DDTCTL_HOME/cache/wheels, keyed by the source identity) for the
    tests below that build this checkout's wheel: one `pip wheel` (~3 s of CPU) instead of two
    where they run in one process. Session scope: a module-scoped fixture would hold the whole
    module on one xdist worker (tests/conftest.py), the 90 s end-to-end deploy with the rest."""
    return tmp_path_factory.mktemp("wheels")


def _share_wheels(home: Path, cache: Path) -> None:
    (home / "cache").mkdir(parents=True, exist_ok=True)
    (home / "cache" / "wheels").symlink_to(cache, target_is_directory=True)


@pytest.mark.slow
def test_an_install_root_the_inventory_accepts_deploys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        wheel_cache: Path) -> None:
    """The characters the inventory allows in a root, in a path long enough (> 127 bytes) that pip
    writes the console script as a /bin/sh launcher: venv, pip install, the console script, the
    manifest and a unit that systemd-analyze accepts."""
    from ddtctl.inventory import parse_inventory
    from ddtctl.ops import packages
    from ddtctl.ops.bundle import build_wheel
    from ddtctl.ops.release_step import venv_python
    from ddtctl.ops.units import render_unit, service_spec

    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    _share_wheels(tmp_path / "home", wheel_cache)
    root = str(tmp_path / "my srv %x,y=z@v+u~t" / ("long-" * 20))
    inv = parse_inventory(f"nodes: {{n: {{address: 10.0.0.1}}}}\n"
                          f"containers: {{c: {{vmid: 100, node: n, address: 10.0.0.5, root: '{root}', "
                          f"service: {{kind: ddtree, port: 8000}}}}}}\n"
                          f"local: {{h: {{root: '{root}', service: {{kind: ddtree, port: 18991}}}}}}\n", tmp_path / "i.yaml")
    host, ct = inv.hosts["h"], inv.hosts["c"]
    bundle, t = build_wheel(), LocalTransport()
    layout = releases.Layout(host.root, host.unit)
    plan = packages.install_plan(host, venv_python(host), posixpath.join(layout.release(bundle.version_id), bundle.wheel.name))
    _, installed = releases.install(t, layout, bundle.version_id, bundle.wheel, venv_python(host), plan,
                                    version=bundle.identity.version)
    launcher = Path(layout.release(bundle.version_id), "venv", "bin", "ddtree-server").read_text()
    assert launcher.startswith("#!/bin/sh\n")                              # pip's launcher for such paths
    check = releases.verify(t, layout, bundle.version_id, venv_python(host), plan.fingerprint, bundle.identity.version)
    assert check.ok, check.summary()
    # install verified from the manifest it wrote (no second listing): the counts a full check finds
    assert installed.ok and (installed.files, installed.hashed) == (check.files, check.hashed) and check.hashed > 100
    cli = next(Path(layout.release(bundle.version_id)).glob("venv/lib/python*/site-packages/ddtree_server/cli.py"))
    st = cli.stat()                                   # same size and mtime: only the install-time hash tells
    cli.write_text(cli.read_text().replace("Print the version.", "Print the versi0n."))
    os.utime(cli, ns=(st.st_atime_ns, st.st_mtime_ns))
    damaged = releases.verify(t, layout, bundle.version_id, venv_python(host), plan.fingerprint, bundle.identity.version)
    assert damaged.stage == "manifest" and any(p.endswith("cli.py: sha256 differs") for p in damaged.problems), damaged
    cli.write_text(cli.read_text().replace("Print the versi0n.", "Print the version."))
    os.utime(cli, ns=(st.st_atime_ns, st.st_mtime_ns))
    releases.switch(t, layout, bundle.version_id)
    if shutil.which("systemd-analyze"):
        unit = tmp_path / "units" / ct.unit
        unit.parent.mkdir()
        unit.write_text(render_unit(service_spec(ct)))
        res = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=120)
        assert not [ln for ln in res.stderr.splitlines() if ct.unit in ln], res.stderr


# ----------------------------------------------------------------------------- slow end to end

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddtctl(env: dict, *args: str, timeout: float = 900) -> tuple[int, dict | None, str]:
    proc = subprocess.run([sys.executable, "-m", "ddtctl", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    doc = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else None
    return proc.returncode, doc, proc.stderr


@pytest.mark.slow
def test_deploy_local_end_to_end(tmp_path: Path, wheel_cache: Path) -> None:
    _share_wheels(tmp_path / "home", wheel_cache)
    port = _free_port()
    inv = tmp_path / "inventory.yaml"
    service = f"{{kind: ddtree, port: {port}, device: cpu, dtype: fp32, ready_timeout_s: 600}}"
    inv.write_text(f"local:\n  local:\n    service: {service}\n")
    env = {**os.environ, "DDTCTL_HOME": str(tmp_path / "home"), "DDTCTL_INVENTORY": str(inv), "NO_COLOR": "1"}
    try:
        code, doc, err = _ddtctl(env, "deploy", "local", "--json")
        assert code == 0, err
        first = doc["hosts"][0]
        assert (first["ok"], first["changed"], first["restarted"]) == (True, True, True), err
        assert first["url"] == f"http://127.0.0.1:{port}/v1" and first["model_id"] == "SmolLM2-135M-Instruct"
        checks = {c["name"]: c["status"] for c in first["smoke"]["checks"]}
        assert checks.pop("acceptance") in ("pass", "n/a")
        assert set(checks.values()) == {"pass"}, first["smoke"]
        assert f"local: serving SmolLM2-135M-Instruct at http://127.0.0.1:{port}/v1" in err
        release = first["release"]
        assert (tmp_path / "home" / "hosts" / "local" / "releases" / release / "venv" / "bin" / "ddtree-server").exists()

        code, doc, err = _ddtctl(env, "deploy", "local", "--json", "--no-smoke")
        second = doc["hosts"][0]
        assert code == 0, err
        assert (second["changed"], second["restarted"], second["weights_bytes_sent"]) == (False, False, 0)
        assert {s["name"]: s["status"] for s in second["steps"]}["restart"] == "ok"
        steps = {s["name"]: s for s in second["steps"]}
        assert steps["release"]["status"] == "ok" and "already installed (verified: " in steps["release"]["detail"]

        # a release is verified, not trusted: a changed file is seen (dry run: nothing done) ...
        rel = tmp_path / "home" / "hosts" / "local" / "releases" / release
        cli = next(rel.glob("venv/lib/python*/site-packages/ddtree_server/cli.py"))
        st = cli.stat()                                          # same size, same mtime: only the hash tells
        cli.write_text(cli.read_text().replace("Print the version.", "Print the versi0n."))
        os.utime(cli, ns=(st.st_atime_ns, st.st_mtime_ns))
        code, doc, err = _ddtctl(env, "deploy", "local", "--json", "--dry-run")
        planned = {s["name"]: s for s in doc["hosts"][0]["steps"]}["release"]
        assert code == 0 and planned["status"] == "planned", err
        assert planned["detail"].startswith(f"install {release}.r2 (system mode, venv from "), planned
        assert f"; {release} failed verification: manifest: " in planned["detail"]
        assert "cli.py: sha256 differs" in planned["detail"]
        # ... and a deleted venv: the release is installed afresh beside it (never repaired in place:
        # the service runs it), the service restarted on the new copy, ready
        shutil.rmtree(rel / "venv")
        code, doc, err = _ddtctl(env, "deploy", "local", "--json", "--no-smoke")
        third = doc["hosts"][0]
        assert code == 0, err
        assert (third["ok"], third["changed"], third["restarted"], third["release"]) == (True, True, True,
                                                                                         f"{release}.r2")
        steps = {s["name"]: s for s in third["steps"]}
        assert steps["release"]["status"] == "changed" and f"{release} failed verification: manifest: " \
            in steps["release"]["detail"] and len(steps["release"]["detail"]) < 1000
        assert steps["current"]["detail"] == f"{release} -> {release}.r2" and steps["wait-ready"]["status"] == "ok"
        assert not (rel / "venv").exists()                                   # the old folder untouched
        release += ".r2"
        code, doc, err = _ddtctl(env, "deploy", "local", "--json", "--no-smoke")
        assert code == 0 and (doc["hosts"][0]["changed"], doc["hosts"][0]["restarted"]) == (False, False), err

        code, doc, err = _ddtctl(env, "status", "local", "--json", "--no-gpu")
        assert code == 0, err
        st = doc["hosts"][0]
        assert st["unit"]["active"] == "active" and st["models"] == ["SmolLM2-135M-Instruct"]
        assert st["release"] == release and st["version_mismatch"] is False

        # a broken service definition: wait-ready fails fast, the previous unit comes back
        inv.write_text(f"local:\n  local:\n    service: {service[:-1]}, extra_args: [--no-such-flag]}}\n")
        code, doc, err = _ddtctl(env, "deploy", "local", "--json", "--no-smoke")
        third = doc["hosts"][0]
        assert code == 1, err
        assert third["rolled_back"] is True and "no-such-flag" in third["error"]
        assert {s["name"]: s["status"] for s in third["steps"]}["rollback"] == "changed", third["steps"]
        code, doc, err = _ddtctl(env, "wait-ready", "local", "--json", "--timeout", "120")
        assert code == 0, err
    finally:
        code, _, err = _ddtctl(env, "stop", "local", timeout=180)
        assert code == 0, err
    code, doc, _ = _ddtctl(env, "status", "local", "--json", "--no-gpu")
    assert code == 1 and doc["hosts"][0]["unit"]["active"] == "inactive"


def test_a_reinstall_reason_is_short_even_when_the_wheelhouse_changed() -> None:
    """The wheel names a release was installed with are compared as what was added and removed
    (the whole lists made a 7.9 KB reason line), and the release step bounds its line."""
    from ddtctl.ops.release_step import _bounded

    was = [f"package_{i}-1.0-py3-none-any.whl" for i in range(80)]
    now = [*was[1:], "package_0-1.1-py3-none-any.whl"]
    (line,) = releases._settings_diff({"wheels": was, "mode": "wheelhouse"}, {"wheels": now, "mode": "wheelhouse"})
    assert line == "wheels: +package_0-1.1-py3-none-any.whl, -package_0-1.0-py3-none-any.whl"
    many = releases._settings_diff({"wheels": was}, {"wheels": [w.replace("1.0", "2.0") for w in was]})[0]
    assert len(many) < 400 and "(80 added, 80 removed)" in many
    assert len(_bounded("x" * 8000)) == 300 and _bounded("a\n b") == "a b"
