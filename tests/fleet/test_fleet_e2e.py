"""End to end: the ddtctl CLI against the 3-container test fleet (tests/fleet/fleet.py) over real SSH.

One session-scoped deployment is shared by the tests of this module, which run in file order:
deploy --all -> status --all --json -> wait-ready ct129 -> smoke --all -> a no-op second deploy ->
a deploy whose server cannot start (rolled back, the previous server serves again). Three real
ddtree-servers load the real SmolLM2 on CPU inside the emulated containers (systemd emulated by
tests/fleet/systemctl, GPUs by tests/fleet/nvidia-smi).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.fleet.fleet import default_gguf
from tests.fleet.fleet_fixtures import fleet  # noqa: F401 - session fixture

pytestmark = [pytest.mark.fleet, pytest.mark.slow]
HOSTS = ("ct200", "ct201", "ct129")


def run_json(fleet, *args: str, timeout: float = 600) -> tuple[int, dict, str]:  # noqa: F811
    t0 = time.monotonic()
    res = fleet.ddtctl(*args, "--json", timeout=timeout)
    print(f"ddtctl {' '.join(args)}: exit {res.returncode} in {time.monotonic() - t0:.1f} s")
    try:
        doc = json.loads(res.stdout)
    except ValueError:
        pytest.fail(f"no JSON on stdout (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res.returncode, doc, res.stderr


def by_host(doc: dict) -> dict[str, dict]:
    return {h["host"]: h for h in doc["hosts"]}


@pytest.fixture(scope="module")
def deployed(fleet):  # noqa: F811
    code, doc, err = run_json(fleet, "deploy", "--all", "--no-smoke")
    units = {name: fleet.show(name) for name in HOSTS}
    return {"code": code, "doc": doc, "stderr": err, "units": units}


def test_first_deploy_reaches_all_three_containers(fleet, deployed):  # noqa: F811
    assert deployed["code"] == 0, deployed["stderr"][-4000:]
    hosts = by_host(deployed["doc"])
    for name in HOSTS:
        h = hosts[name]
        assert h["ok"] and h["changed"] and h["restarted"], h
        unit = deployed["units"][name]
        assert (unit["ActiveState"], unit["SubState"], unit["Result"]) == ("active", "running", "success")
        assert unit["UnitFileState"] == "enabled" and int(unit["MainPID"]) > 0
        assert "state ready" in fleet.journal(name, 200)          # READY=1 after warm-up, in the journal
    assert hosts["ct200"]["weights_bytes_sent"] == default_gguf().stat().st_size  # push: into the CT
    assert hosts["ct201"]["weights_bytes_sent"] > 400_000_000                     # shared: to the node
    assert hosts["ct129"]["weights_bytes_sent"] == 0                              # embedded default
    shared = fleet.exec("ct201", "ls", "/srv/models/SmolLM2-135M-Instruct").stdout.split()
    assert "model.safetensors" in shared and "config.json" in shared             # seen through the bind
    assert fleet.exec("ct201", "touch", "/srv/models/SmolLM2-135M-Instruct/x").returncode != 0   # read-only


def test_status_all_json_reports_units_models_and_gpus(fleet, deployed):  # noqa: F811
    code, doc, err = run_json(fleet, "status", "--all")
    assert code == 0, err[-3000:]
    hosts = by_host(doc)
    for name in HOSTS:
        h = hosts[name]
        assert h["ok"] and h["ready"] and h["unit"]["active"] == "active", h
        assert h["models"] == ["SmolLM2-135M-Instruct"] and not h["version_mismatch"]
    assert hosts["ct200"]["gpus"][0] == {"index": 0, "name": "NVIDIA H200", "memory_total_mib": 143771,
                                         "memory_used_mib": 1024, "utilization_pct": 3,
                                         "driver_version": "570.133.20", "mig_mode": "Disabled", "notes": {},
                                         "labels": {}}
    na = hosts["ct201"]["gpus"][0]                               # nvidia-smi's [N/A], kept with its meaning
    assert na["memory_used_mib"] == "[N/A]" and na["utilization_pct"] == "[N/A]" and na["memory_total_mib"] == 143771
    assert na["notes"]["[N/A]"]
    bad = hosts["ct129"]
    assert bad["gpus"] is None and bad["gpu_error"]["exit_code"] == 18
    assert "mismatch" in bad["gpu_error"]["problem"] and bad["gpu_error"]["hint"]


def test_wait_ready_ct129(fleet, deployed):  # noqa: F811
    code, doc, err = run_json(fleet, "wait-ready", "ct129", "--timeout", "120")
    assert code == 0 and doc["ready"] and doc["models"] == ["SmolLM2-135M-Instruct"], err[-3000:]


def test_smoke_all_passes(fleet, deployed):  # noqa: F811
    code, doc, err = run_json(fleet, "smoke", "--all")
    assert code == 0 and doc["ok"], err[-4000:]
    assert sorted(h["host"] for h in doc["hosts"]) == sorted(HOSTS)


def test_second_deploy_changes_nothing(fleet, deployed):  # noqa: F811
    code, doc, err = run_json(fleet, "deploy", "--all", "--no-smoke")
    assert code == 0, err[-4000:]
    for name, h in by_host(doc).items():
        assert h["ok"] and not h["changed"] and not h["restarted"], (name, h["steps"])
        assert h["weights_bytes_sent"] == 0
        before, now = deployed["units"][name], fleet.show(name)
        assert (now["MainPID"], now["NRestarts"]) == (before["MainPID"], before["NRestarts"])
        assert now["ActiveState"] == "active"


def test_deploy_whose_server_cannot_start_rolls_back(fleet, deployed, tmp_path):  # noqa: F811
    before = fleet.show("ct129")
    bad = fleet.write_inventory(tmp_path / "bad.yaml",
                                {"ct129": {"extra_args": ["--gguf", "/srv/models/missing.gguf"]}})
    t0 = time.monotonic()
    code, doc, err = run_json(fleet, "--inventory", str(bad), "deploy", "ct129", "--no-smoke")
    seconds = time.monotonic() - t0
    h = by_host(doc)["ct129"]
    assert code == 1 and not h["ok"] and h["rolled_back"], (h, err[-3000:])
    assert [s["name"] for s in h["steps"] if s["status"] == "changed"][-1] == "rollback", h["steps"]
    assert "ddtree-ct129.service" in h["error"]                   # systemctl's job failure (or wait-ready's)
    assert seconds < 240
    now = fleet.show("ct129")
    assert now["ActiveState"] == "active" and now["MainPID"] != before["MainPID"]
    assert "missing.gguf" not in fleet.exec("ct129", "cat", "/etc/systemd/system/ddtree-ct129.service").stdout
    port = fleet.specs["ct129"].port
    models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
    assert "missing.gguf" in fleet.journal("ct129", 400)          # the bad server's error is in the journal
    assert "missing.gguf" in h["error"], h["error"]              # ... and ddtctl reports those lines


def test_a_held_lock_stops_the_deploy_and_break_lock_clears_it(fleet, deployed):  # noqa: F811
    """The lock lives in the container (/opt/ddtree/.ddtctl.lock) and travels through real sshd ->
    pct exec like every other command; deploys leave none behind."""
    for name in HOSTS:
        assert fleet.exec(name, "test", "-e", "/opt/ddtree/.ddtctl.lock").returncode != 0, name
    assert fleet.exec("ct200", "mkdir", "/opt/ddtree/.ddtctl.lock").returncode == 0
    code, doc, err = run_json(fleet, "deploy", "ct200", "--no-smoke")
    h = by_host(doc)["ct200"]
    assert code == 1 and not h["ok"] and not h["changed"] and "locked by" in h["error"], (h, err[-2000:])
    assert "Traceback" not in err
    code, doc, err = run_json(fleet, "deploy", "ct200", "--no-smoke", "--break-lock")
    h = by_host(doc)["ct200"]
    assert code == 0 and h["ok"] and not h["restarted"], (h, err[-2000:])
    assert fleet.exec("ct200", "test", "-e", "/opt/ddtree/.ddtctl.lock").returncode != 0
