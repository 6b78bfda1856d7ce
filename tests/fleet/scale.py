"""A wide test fleet: N emulated Proxmox nodes x M containers (default 4 x 8 = 32), each container
running the external-engine emulation (tests/fleet/fake_engine, kind `vllm`) under the systemctl
emulation, with a GPU scenario for the nvidia-smi emulation. It is the fleet of the connection
sharing test (tests/fleet/test_scale.py) and of the `status --all` timing
(`python -m tests.fleet.scale_bench`, docs/benchmarks/status-scale.*).

Nodes are real sshd processes on 127.0.0.1 (tests/fleet/node.py, named `sc-0`, `sc-1`, ...);
containers `sc<node><n>` with vmids 500 + 10 * node + n; services on distinct free loopback ports.
ddtctl runs as a real `python -m ddtctl` process from the repository root with a hermetic
DDTCTL_SSH_CONFIG, DDTCTL_HOME and inventory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.fleet.node import FakeNode, fleet_base, shared_node
from tests.fleet.sshd import free_port

FLEET_DIR = Path(__file__).resolve().parent
REPO = FLEET_DIR.parents[1]
EMU_LIB = "/usr/lib/ddt-fleet-emu"
ENGINE = "/usr/local/lib/ddt-fake-engine/fake_engine"
MODEL_PATH = "/srv/sc/model.bin"


class ScaleFleet:
    def __init__(self, base: Path, nodes: int = 4, per_node: int = 8):
        self.base = Path(base)
        self.node_names = [f"sc-{i}" for i in range(nodes)]
        self.containers = {f"sc{i}{n}": (f"sc-{i}", 500 + 10 * i + n)
                           for i in range(nodes) for n in range(per_node)}
        self.ports = {name: free_port() for name in self.containers}
        self.nodes: dict[str, FakeNode] = {}
        self.inventory = self.base / "inventory.yaml"
        self.ssh_config = self.base / "ssh_config"
        self.known_hosts = self.base / "known_hosts"
        self.home = self.base / "home"
        self.model = self.base / "model.bin"
        self.gpu_file = self.base / "h200.json"

    def start(self) -> "ScaleFleet":
        self.base.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(exist_ok=True)
        self.model.write_bytes(b"weights of the engine emulation\n")
        self.gpu_file.write_text(json.dumps({}))             # a healthy H200 (nvidia-smi emulation)
        for name, (node, vmid) in self.containers.items():
            self.nodes.setdefault(node, shared_node(node))
            binds = {"/usr/bin/nvidia-smi": FLEET_DIR / "nvidia-smi", "/usr/bin/systemctl": FLEET_DIR / "systemctl",
                     "/usr/bin/journalctl": FLEET_DIR / "journalctl", f"{EMU_LIB}/emu": FLEET_DIR / "emu",
                     "/var/log/ddt-emu/nvidia-smi.json": self.gpu_file, ENGINE: FLEET_DIR / "fake_engine"}
            if vmid not in self.nodes[node].running():
                if (self.nodes[node].state / "lxc" / f"{vmid}.conf").exists():
                    self.nodes[node].pct("start", str(vmid))
                else:
                    self.nodes[node].create_container(vmid, name, binds=binds)
        self.known_hosts.write_text("".join(n.sshd.known_hosts_line + "\n" for n in self.nodes.values()))
        self.ssh_config.write_text("# hermetic: replaces ~/.ssh/config (DDTCTL_SSH_CONFIG)\n")
        self.inventory.write_text(yaml.safe_dump(self.inventory_doc(), sort_keys=False))
        return self

    def inventory_doc(self) -> dict:
        nodes = {node: {"address": "127.0.0.1", "port": n.sshd.port, "user": "root",
                        "ssh_options": {"IdentityFile": str(fleet_base() / "id_ed25519"),
                                        "UserKnownHostsFile": str(self.known_hosts),
                                        "StrictHostKeyChecking": "yes"}}
                 for node, n in self.nodes.items()}
        containers = {
            name: {"vmid": vmid, "node": node, "address": "127.0.0.1", "groups": ["sc"],
                   "service": {"kind": "vllm", "executable": ENGINE, "port": self.ports[name],
                               "bind": "127.0.0.1", "unit": f"fake-{name}.service", "model_id": "fake",
                               "gpus": [0], "ready_timeout_s": 60,
                               "target": {"path": MODEL_PATH, "source": str(self.model)}}}
            for name, (node, vmid) in self.containers.items()}
        return {"nodes": nodes, "containers": containers}

    def env(self) -> dict:
        return {**os.environ, "DDTCTL_INVENTORY": str(self.inventory), "DDTCTL_SSH_CONFIG": str(self.ssh_config),
                "DDTCTL_HOME": str(self.home), "NO_COLOR": "1", "COLUMNS": "200"}

    def ddtctl(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ddtctl", *args], env=self.env(), cwd=REPO,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def logins(self) -> dict[str, int]:
        """SSH logins each node's sshd has accepted so far (its VERBOSE log)."""
        return {name: len(re.findall(r"Accepted publickey for ", n.sshd.log)) for name, n in self.nodes.items()}

    def stop_services(self) -> None:
        for name, (node, vmid) in self.containers.items():
            self.nodes[node].pct("exec", str(vmid), "--", "systemctl", "stop", f"fake-{name}.service", check=False)

    def close(self) -> None:
        for name, (node, vmid) in self.containers.items():
            n = self.nodes.get(node)
            if n and vmid in n.running():
                n.pct("stop", str(vmid), check=False)
