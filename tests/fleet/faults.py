"""A small fleet for fault tests (tests by class: a frozen node, a killed sshd, Ctrl-C, exec).

Two emulated Proxmox nodes (`fz-a`, `fz-b`: real sshd + the pct emulation, tests/fleet/node.py),
one container each: ct310 on fz-a (its `dd` slowed down by tests/fleet/slow_dd, so a push lasts a
few seconds) and ct311 on fz-b. Each runs an external-engine emulation (tests/fleet/fake_engine,
kind `vllm`) under the systemctl emulation, with a pushed weights file, so `deploy` exercises the
lock, a streamed push, unit files, restart and readiness in seconds. The nodes' ssh_options set
short deadlines (ConnectTimeout 2 s, ServerAliveInterval 1 s x ServerAliveCountMax 2): a silent
node is noticed within ~2 s here (ddtctl's defaults: 10 s and 10 s x 3).

ddtctl runs as a real `python -m ddtctl` process from the repository root, with a hermetic
DDTCTL_SSH_CONFIG, DDTCTL_HOME and inventory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.fleet.node import FakeNode, fleet_base, shared_node
from tests.fleet.sshd import free_port

FLEET_DIR = Path(__file__).resolve().parent
REPO = FLEET_DIR.parents[1]
EMU_LIB = "/usr/lib/ddt-fleet-emu"
# tests/fleet/fake_engine as the containers see it; not under EMU_LIB: a mount point made inside a
# directory that an earlier bind created would lay an overlay over that bind (pctemu/ns.py _make)
ENGINE = "/usr/local/lib/ddt-fake-engine/fake_engine"
CONTAINERS = {"ct310": ("fz-a", 310), "ct311": ("fz-b", 311)}
BLOB_PATH = "/srv/fz/blob.bin"
ALIVE = {"ConnectTimeout": "2", "ServerAliveInterval": "1", "ServerAliveCountMax": "2"}


class FaultFleet:
    def __init__(self, base: Path):
        self.base = Path(base)
        self.nodes: dict[str, FakeNode] = {}
        self.ports = {name: free_port() for name in CONTAINERS}
        self.inventory = self.base / "inventory.yaml"
        self.ssh_config = self.base / "ssh_config"
        self.known_hosts = self.base / "known_hosts"
        self.home = self.base / "home"
        self.blob = self.base / "blob.bin"

    def start(self) -> "FaultFleet":
        self.base.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(exist_ok=True)
        for name, (node, vmid) in CONTAINERS.items():
            self.nodes.setdefault(node, shared_node(node))
            # the engine is bound in like the emulators: a checkout under a container-private dir
            # (/root, /tmp: tests/fleet/pctemu/ns.py) is not visible inside the container
            binds = {"/usr/bin/systemctl": FLEET_DIR / "systemctl", "/usr/bin/journalctl": FLEET_DIR / "journalctl",
                     f"{EMU_LIB}/emu": FLEET_DIR / "emu", ENGINE: FLEET_DIR / "fake_engine"}
            if name == "ct310":
                binds["/usr/local/bin/dd"] = FLEET_DIR / "slow_dd"
            if vmid not in self.nodes[node].running():
                self.nodes[node].create_container(vmid, name, binds=binds)
        self.known_hosts.write_text("".join(n.sshd.known_hosts_line + "\n" for n in self.nodes.values()))
        self.ssh_config.write_text("# hermetic: replaces ~/.ssh/config (DDTCTL_SSH_CONFIG)\n")
        self.new_blob()
        self.write_inventory()
        return self

    def new_blob(self, mib: int = 24) -> None:
        """A new weights file: the next deploy pushes it (in 8 MiB `dd` chunks)."""
        self.blob.write_bytes(os.urandom(mib * 1024 * 1024))

    def node_of(self, name: str) -> FakeNode:
        return self.nodes[CONTAINERS[name][0]]

    def inventory_doc(self) -> dict:
        nodes = {node: {"address": "127.0.0.1", "port": n.sshd.port, "user": "root",
                        "ssh_options": {"IdentityFile": str(fleet_base() / "id_ed25519"),
                                        "UserKnownHostsFile": str(self.known_hosts),
                                        "StrictHostKeyChecking": "yes", **ALIVE}}
                 for node, n in self.nodes.items()}
        containers = {
            name: {"vmid": vmid, "node": node, "address": "127.0.0.1", "groups": ["fz"],
                   "service": {"kind": "vllm", "executable": ENGINE, "port": self.ports[name],
                               "bind": "127.0.0.1", "unit": f"fake-{name}.service", "model_id": "fake",
                               "ready_timeout_s": 30,
                               "target": {"path": BLOB_PATH, "source": str(self.blob)}}}
            for name, (node, vmid) in CONTAINERS.items()}
        return {"nodes": nodes, "containers": containers}

    def write_inventory(self) -> None:
        self.inventory.write_text(yaml.safe_dump(self.inventory_doc(), sort_keys=False))

    def env(self) -> dict:
        return {**os.environ, "DDTCTL_INVENTORY": str(self.inventory), "DDTCTL_SSH_CONFIG": str(self.ssh_config),
                "DDTCTL_HOME": str(self.home), "NO_COLOR": "1", "COLUMNS": "200"}

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "ddtctl", *args]

    def ddtctl(self, *args: str, timeout: float = 120, stdin: bytes | None = None
               ) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), env=self.env(), cwd=REPO, capture_output=True,
                              timeout=timeout, input=stdin if stdin is not None else b"")

    def popen(self, *args: str, **kw) -> subprocess.Popen:
        kw.setdefault("stdin", subprocess.DEVNULL)
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        return subprocess.Popen(self.argv(*args), env=self.env(), cwd=REPO, **kw)

    def exec_in(self, name: str, *argv: str) -> subprocess.CompletedProcess:
        """argv inside container `name` through the pct emulation (inspection only)."""
        return self.node_of(name).pct("exec", str(CONTAINERS[name][1]), "--", *argv, check=False)

    def private(self, name: str, ct_path: str) -> Path:
        return self.node_of(name).private_path(CONTAINERS[name][1], ct_path)
