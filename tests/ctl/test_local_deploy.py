"""The local host end to end, on real processes and files (no mocks).

Fast: the local process supervisor on real child processes; weight manifests and release links
through the real LocalTransport. Slow (`-m slow`): `ddtctl deploy local` as a user runs it: real
wheel build, venv, the real ddtree-server with the embedded SmolLM2, wait-ready, smoke; a second
deploy changes nothing; a broken deploy rolls back; stop.
"""

from __future__ import annotations

import json
import os
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
def test_deploy_local_end_to_end(tmp_path: Path) -> None:
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
