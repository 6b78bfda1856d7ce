"""Weights verified by content, and `status` telling the truth, on a small fleet over real SSH.

Node `tr-a` (real sshd + the pct emulation), containers running the external-engine emulation
(tests/fleet/fake_engine, kind `vllm`, seconds to start) under the systemctl emulation:
* ct370: a 24 MiB weights file pushed into it; the CUDA device nodes a real GPU container gets by
  `lxc.mount.entry` binds of the node's devices (here /dev/null, a character device, stands for
  each): /dev/nvidia0, /dev/nvidiactl, /dev/nvidia-uvm;
* ct371: the same without /dev/nvidia-uvm (the node never loaded nvidia-uvm);
* ct372: a `ddtree` host whose unit (written by hand) runs the engine emulation with a stuck
  engine: /ready 200, /health 503 "stalled";
* `ghost` (ct373): a container whose unit was never installed (systemd: LoadState=not-found);
* `gone`: a node the ssh configuration resolves (HostName/Port), where nothing listens.
Faults: a same-size overwrite of the pushed file (`dd conv=notrunc`), then one with its mtime put
back (only `deploy --verify` sees it); a unit that cannot start after older journal lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fleet.node import fleet_available, fleet_base, shared_node
from tests.fleet.sshd import free_port

pytestmark = [pytest.mark.fleet]
FLEET_DIR = Path(__file__).resolve().parent
REPO = FLEET_DIR.parents[1]
EMU_LIB = "/usr/lib/ddt-fleet-emu"
ENGINE = "/usr/local/lib/ddt-fake-engine/fake_engine"
BLOB = "/srv/tr/blob.bin"
NODE = "tr-a"
CTS = {"ct370": 370, "ct371": 371, "ct372": 372, "ghost": 373}
DEVICES = {"ct370": ("nvidia0", "nvidiactl", "nvidia-uvm"), "ct371": ("nvidia0", "nvidiactl"), "ct372": (),
           "ghost": ()}
STALLED_UNIT = """[Unit]
Description=engine with a stuck round
[Service]
Type=exec
ExecStart=/usr/bin/python3 {engine} serve m --host 127.0.0.1 --port {port} --served-model-name x --stalled
[Install]
WantedBy=multi-user.target
"""


class TruthFleet:
    def __init__(self, base: Path):
        self.base, self.node = base, shared_node(NODE)
        self.ports = {name: free_port() for name in (*CTS, "faraway")}
        self.blob = base / "blob.bin"
        self.blob.write_bytes(os.urandom(24 * 1024 * 1024))
        self.inventory, self.home = base / "inventory.yaml", base / "home"
        self.ssh_config, self.known_hosts = base / "ssh_config", base / "known_hosts"
        self.gone_port = free_port()

    def start(self) -> TruthFleet:
        for name, vmid in CTS.items():
            binds = {"/usr/bin/systemctl": FLEET_DIR / "systemctl", "/usr/bin/journalctl": FLEET_DIR / "journalctl",
                     f"{EMU_LIB}/emu": FLEET_DIR / "emu", ENGINE: FLEET_DIR / "fake_engine"}
            binds.update({f"/dev/{dev}": "/dev/null" for dev in DEVICES[name]})
            if vmid not in self.node.running():
                self.node.create_container(vmid, name, binds=binds)
        self.known_hosts.write_text(self.node.sshd.known_hosts_line + "\n")
        self.ssh_config.write_text(f"Host tr-gone\n  HostName 127.0.0.1\n  Port {self.gone_port}\n")
        opts = {"IdentityFile": str(fleet_base() / "id_ed25519"), "UserKnownHostsFile": str(self.known_hosts),
                "StrictHostKeyChecking": "yes", "ConnectTimeout": "2"}
        nodes = {NODE: {"address": "127.0.0.1", "port": self.node.sshd.port, "user": "root", "ssh_options": opts},
                 "gone": {"address": "tr-gone", "user": "root", "ssh_options": opts}}   # port: the ssh config's

        def engine(name: str, **extra) -> dict:
            return {"kind": "vllm", "executable": ENGINE, "port": self.ports[name], "bind": "127.0.0.1",
                    "unit": f"fake-{name}.service", "model_id": "fake", "ready_timeout_s": 30, "gpus": [0],
                    "target": {"path": BLOB, "source": str(self.blob)}, **extra}

        ddtree = {"kind": "ddtree", "bind": "127.0.0.1", "device": "cpu", "python": sys.executable}
        containers = {
            "ct370": {"vmid": 370, "node": NODE, "address": "127.0.0.1", "service": engine("ct370")},
            "ct371": {"vmid": 371, "node": NODE, "address": "127.0.0.1", "service": engine("ct371")},
            "ct372": {"vmid": 372, "node": NODE, "address": "127.0.0.1", "service": {
                **ddtree, "port": self.ports["ct372"], "unit": "stalled.service", "model_id": "x"}},
            "ghost": {"vmid": 373, "node": NODE, "address": "127.0.0.1", "service": {
                **ddtree, "port": self.ports["ghost"], "unit": "ghost.service"}},
            "faraway": {"vmid": 370, "node": "gone", "address": "127.0.0.1", "service": {
                **ddtree, "port": self.ports["faraway"]}}}
        self.inventory.write_text(yaml.safe_dump({"nodes": nodes, "containers": containers}, sort_keys=False))
        unit = STALLED_UNIT.format(engine=ENGINE, port=self.ports["ct372"])
        made = self.exec_in("ct372", "sh", "-c", 'printf %s "$1" > /etc/systemd/system/stalled.service && '
                            "systemctl daemon-reload && systemctl start stalled.service", "sh", unit)
        assert made.returncode == 0, made.stderr
        return self

    def ddtctl(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        env = {**os.environ, "DDTCTL_INVENTORY": str(self.inventory), "DDTCTL_SSH_CONFIG": str(self.ssh_config),
               "DDTCTL_HOME": str(self.home), "NO_COLOR": "1", "COLUMNS": "250"}
        res = subprocess.run([sys.executable, "-m", "ddtctl", *args], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        print(f"ddtctl {' '.join(args)}: exit {res.returncode}\n{res.stderr[-4000:]}")
        return res

    def exec_in(self, name: str, *argv: str) -> subprocess.CompletedProcess:
        return self.node.pct("exec", str(CTS[name]), "--", *argv, check=False)

    def close(self) -> None:
        for vmid in CTS.values():
            if vmid in self.node.running():
                self.node.pct("stop", str(vmid), check=False)


@pytest.fixture(scope="module")
def tfleet(tmp_path_factory):
    reason = fleet_available()
    if reason:
        pytest.skip(reason)
    fleet = TruthFleet(tmp_path_factory.mktemp("truth"))
    try:
        fleet.start()
        res = fleet.ddtctl("deploy", "ct370", "ct371", "--no-smoke")
        assert res.returncode == 0, res.stderr[-3000:]
        yield fleet
    finally:
        fleet.close()


def _weights_step(res: subprocess.CompletedProcess) -> dict:
    host = json.loads(res.stdout)["hosts"][0]
    return next(s for s in host["steps"] if s["name"] == "weights:target")


def _sha_in(fleet: TruthFleet) -> str:
    return fleet.exec_in("ct370", "sha256sum", BLOB).stdout.split()[0]


def _corrupt(fleet: TruthFleet, keep_mtime: bool = False) -> None:
    """4 KiB of random bytes written over the middle of the pushed file, size unchanged."""
    size = fleet.exec_in("ct370", "stat", "-c", "%s", BLOB).stdout
    if keep_mtime:
        assert fleet.exec_in("ct370", "touch", "-r", BLOB, "/srv/tr/ref").returncode == 0
    dd = fleet.exec_in("ct370", "dd", "if=/dev/urandom", f"of={BLOB}", "bs=4096", "count=1", "seek=1000",
                       "conv=notrunc", "status=none")
    assert dd.returncode == 0, dd.stderr
    if keep_mtime:
        assert fleet.exec_in("ct370", "touch", "-r", "/srv/tr/ref", BLOB).returncode == 0
    assert fleet.exec_in("ct370", "stat", "-c", "%s", BLOB).stdout == size
    assert _sha_in(fleet) != hashlib.sha256(fleet.blob.read_bytes()).hexdigest()


def test_same_size_corruption_of_pushed_weights_is_noticed_and_repaired(tfleet):
    local = hashlib.sha256(tfleet.blob.read_bytes()).hexdigest()
    _corrupt(tfleet)
    res = tfleet.ddtctl("deploy", "ct370", "--no-smoke", "--json")
    step = _weights_step(res)
    assert res.returncode == 0 and step["status"] == "changed", step
    assert step["detail"].startswith(f"{BLOB}: 1/1 files, {24 * 1024 * 1024} bytes sent"), step
    assert "1 re-hashed on the target (changed there since the last push), 1 differed" in step["detail"]
    assert _sha_in(tfleet) == local
    res = tfleet.ddtctl("deploy", "ct370", "--no-smoke", "--json")       # cheap again: nothing re-hashed
    step = _weights_step(res)
    assert step["status"] == "ok" and step["detail"] == f"{BLOB}: 0/1 files, 0 bytes sent", step


def test_deploy_verify_rehashes_everything_even_with_the_mtime_put_back(tfleet):
    local = hashlib.sha256(tfleet.blob.read_bytes()).hexdigest()
    _corrupt(tfleet, keep_mtime=True)           # size, mtime and inode as recorded: only a hash tells
    step = _weights_step(tfleet.ddtctl("deploy", "ct370", "--no-smoke", "--json"))
    assert step["detail"] == f"{BLOB}: 0/1 files, 0 bytes sent", step          # the documented limit
    res = tfleet.ddtctl("deploy", "ct370", "--no-smoke", "--json", "--verify")
    step = _weights_step(res)
    assert res.returncode == 0 and step["status"] == "changed", step
    assert "1 re-hashed on the target, 1 differed and were sent again" in step["detail"], step
    assert _sha_in(tfleet) == local


@pytest.fixture(scope="module")
def status_all(tfleet):
    res = tfleet.ddtctl("status", "--all", "--json", "--no-gpu")
    return res, {h["host"]: h for h in json.loads(res.stdout)["hosts"]}


def _row(stderr: str, host: str) -> str:
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"│ {host} "))
    end = start + 1
    while end < len(lines) and lines[end].startswith("│  "):
        end += 1
    cells = zip(*(line.split("│") for line in lines[start:end]), strict=False)
    return " │ ".join(" ".join(part.strip() for part in cell if part.strip()) for cell in cells)


def test_a_cuda_service_without_nvidia_uvm_is_not_ok(status_all):
    res, hosts = status_all
    good, bad = hosts["ct370"], hosts["ct371"]
    assert good["ok"] and good["devices"]["missing"] == [] and "/dev/nvidia-uvm" in good["devices"]["present"], good
    assert not bad["ok"] and bad["verdict"] == "no GPU device" and bad["devices"]["missing"] == ["/dev/nvidia-uvm"]
    assert bad["cause"].startswith("/dev/nvidia-uvm missing in the container"), bad["cause"]
    assert "no GPU device: /dev/nvidia-uvm missing" in _row(res.stderr, "ct371")


def test_a_stalled_engine_is_stalled_not_ok(status_all):
    res, hosts = status_all
    h = hosts["ct372"]
    assert h["unit"]["active"] == "active" and h["ready"] is True and h["live"] is False, h
    assert not h["ok"] and h["verdict"] == "stalled" and "--stall-seconds 300" in h["cause"], h
    assert "stalled: /health 503: stalled: the engine round" in _row(res.stderr, "ct372")


def test_a_unit_systemd_does_not_know_is_not_installed(status_all):
    res, hosts = status_all
    h = hosts["ghost"]
    assert h["unit"]["installed"] is False and h["verdict"] == "not installed" and not h["ok"], h
    assert h["cause"] == "ghost.service is not installed (systemd: LoadState=not-found): deploy it " \
                         "(ddtctl deploy ghost)"
    row = _row(res.stderr, "ghost")
    assert " │ ddtree │ not installed │ " in row and "not installed: ghost.service" in row, row


def test_an_unreachable_node_shows_the_port_ssh_resolves(status_all, tfleet):
    res, hosts = status_all
    h = hosts["faraway"]
    assert h["unreachable"] and h["verdict"] == "unreachable", h
    line = next(e for e in h["errors"] if e.startswith("unreachable"))
    assert f"(node gone at 127.0.0.1:{tfleet.gone_port})" in line and "None" not in res.stderr, line


def test_a_failed_start_shows_its_cause_before_older_log_lines(tfleet):
    for _ in range(3):                          # older journal lines of good starts
        assert tfleet.ddtctl("restart", "ct371").returncode == 0
    doc = yaml.safe_load(tfleet.inventory.read_text())
    doc["containers"]["ct371"]["service"]["extra_args"] = ["--delay", "not-a-number"]
    bad = tfleet.base / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    res = tfleet.ddtctl("deploy", "ct371", "--no-smoke", "--json", "-i", str(bad), "--timeout", "20")
    host = json.loads(res.stdout)["hosts"][0]
    assert res.returncode == 1 and host["rolled_back"], host
    error = host["error"].splitlines()
    assert error[1].startswith("cause: ") and "invalid float value: 'not-a-number'" in error[1], error[:4]
    assert not any("fake engine serving" in line for line in error[:3]), error[:6]
