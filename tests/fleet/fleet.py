"""A test fleet for ddtctl end to end: 2 emulated Proxmox nodes, 3 containers, a generated inventory.

* Nodes `fleet-a` and `fleet-b`: each a REAL OpenSSH server on 127.0.0.1 with its own port, host
  key and node state (tests/fleet/node.py); `pct` over SSH is the emulation (tests/fleet/pct).
* Containers: ct200 and ct201 on fleet-a, ct129 on fleet-b (persistent mount namespaces). Each
  container's view gets the emulated /usr/bin/systemctl, /usr/bin/journalctl and
  /usr/bin/nvidia-smi bound in (their modules at /usr/lib/ddt-fleet-emu), a per-container
  nvidia-smi scenario at /var/log/ddt-emu/nvidia-smi.json (rewritten in place by `set_gpu`), and
  read-only binds of what a real GPU container would have installed by its admin: this machine's
  Python (torch, transformers, ...) at the same path, and the server's converted-GGUF cache
  (~/.cache/ddtree-server, so three containers do not each dequantise SmolLM2 again).
  Sources inside the pct emulation's container-private dirs (/root/...) are first bind-mounted to
  a staging dir under the fleet directory: ns.py resolves bind sources after it has covered the
  private dirs, so `/root/.pyenv/...` would name the container's own (empty) /root there.
* Weights: ct200 `push` (the SmolLM2 GGUF pushed into the container), ct201 `shared` (an HF folder
  synced once to fleet-a's models_root and bind-mounted read-only at /srv/models; the mount point is
  configured when the container is created, because the pct emulation applies `pct set -mpN` only
  at the next start while a real PVE node hot-plugs it), ct129 the server's embedded default.
* Services listen on distinct free loopback ports (bind 127.0.0.1; containers share the host
  network namespace), device cpu, dtype fp32. GPU scenarios: ct200 a healthy H200, ct201 an H200
  with `[N/A]` fields, ct129 "Driver/library version mismatch" (exit 18).
The inventory never names anything but 127.0.0.1 and paths under the fleet directory.
ddtctl runs from a snapshot of ddtctl/, server/ and templates/ taken at start (PYTHONPATH), so
edits to the checkout during the session do not change the release it deploys.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.fleet.node import FakeNode, fleet_base, shared_node
from tests.fleet.pctemu.ns import PRIVATE_DIRS
from tests.fleet.sshd import free_port

FLEET_DIR = Path(__file__).resolve().parent
REPO = FLEET_DIR.parents[1]
EMU_LIB = "/usr/lib/ddt-fleet-emu"
CACHE = Path.home() / ".cache" / "ddtree-server"
SHARED_MODEL = "SmolLM2-135M-Instruct"         # the model id; also the shared HF folder's name
SCENARIOS = {
    "h200": {},
    "h200_na": {"gpus": [{"memory.used": "[N/A]", "utilization.gpu": "[N/A]"}]},
    "driver_mismatch": {"error": "driver_mismatch"},
}


@dataclass
class CtSpec:
    name: str
    vmid: int
    node: str
    weights: str | None               # "push" | "shared" | None (embedded default model)
    gpu: str                          # key of SCENARIOS
    port: int = 0
    unit: str = ""
    extra: dict = field(default_factory=dict)


DEFAULT_SPECS = (CtSpec("ct200", 200, "fleet-a", "push", "h200"),
                 CtSpec("ct201", 201, "fleet-a", "shared", "h200_na"),
                 CtSpec("ct129", 129, "fleet-b", None, "driver_mismatch"))


def default_gguf() -> Path:
    from ddtree_server.models.default import default_gguf_path   # no torch import
    return default_gguf_path(verify=False)


def hf_folder() -> Path:
    """The dequantised SmolLM2 HF folder in the server cache (converted once if missing)."""
    from ddtree_server.models.default import DEFAULT_GGUF_SHA256
    folder = CACHE / DEFAULT_GGUF_SHA256[:16]
    if not (folder / "model.safetensors").is_file():
        code = ("from ddtree_server.models.load import gguf_to_folder; import sys; "
                "gguf_to_folder(sys.argv[1], sys.argv[2])")
        subprocess.run([sys.executable, "-c", code, str(default_gguf()), DEFAULT_GGUF_SHA256],
                       check=True, timeout=900)
    return folder


def _private(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in PRIVATE_DIRS)


class Fleet:
    def __init__(self, base: Path, specs=DEFAULT_SPECS):
        self.base = Path(base)
        self.specs = {s.name: CtSpec(**{**s.__dict__}) for s in specs}
        self.nodes: dict[str, FakeNode] = {}
        self.inventory = self.base / "inventory.yaml"
        self.ssh_config = self.base / "ssh_config"
        self.known_hosts = self.base / "known_hosts"
        self.home = self.base / "ddtctl-home"
        self.staged: list[Path] = []

    # ---- set-up --------------------------------------------------------------------------------
    def start(self) -> "Fleet":
        self.base.mkdir(parents=True, exist_ok=True)
        for spec in self.specs.values():
            spec.port = spec.port or free_port()
            spec.unit = spec.unit or f"ddtree-{spec.name}.service"
            if spec.node not in self.nodes:
                self.nodes[spec.node] = shared_node(spec.node)
                (self.models_root(spec.node)).mkdir(parents=True, exist_ok=True)
        self.known_hosts.write_text("".join(n.sshd.known_hosts_line + "\n" for n in self.nodes.values()))
        # hermetic: replaces ~/.ssh/config for ddtctl (DDTCTL_SSH_CONFIG). AES-GCM first: ~1.3 GB of
        # pushes over loopback cost a third less CPU (ddtctl and sshd) than Paramiko's aes128-ctr +
        # hmac-sha2-256 (measured on 538 MB: 5.1 -> 3.5 s)
        self.ssh_config.write_text("Ciphers aes128-gcm@openssh.com,aes256-gcm@openssh.com,aes128-ctr\n")
        self.home.mkdir(exist_ok=True)
        self.share_wheel_cache()
        self.snapshot()
        hf_folder()                      # converted before the cache is bound into containers
        for spec in self.specs.values():
            self._create(spec)
        self.write_inventory(self.inventory)
        return self

    def snapshot(self) -> Path:
        """Copy ddtctl/, server/, templates/ to <base>/src (a fresh copy: nothing stale kept)."""
        src = self.base / "src"
        for part in ("ddtctl", "server", "templates"):
            shutil.rmtree(src / part, ignore_errors=True)
            shutil.copytree(REPO / part, src / part,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".*"))
        return src

    def write_inventory(self, path: Path, service_overrides: dict[str, dict] | None = None) -> Path:
        """Write the inventory (optionally with per-container `service:` keys replaced) to `path`."""
        doc = self.inventory_doc()
        for name, over in (service_overrides or {}).items():
            doc["containers"][name]["service"].update(over)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def models_root(self, node: str) -> Path:
        return self.base / node / "models"

    def scenario_file(self, name: str) -> Path:
        return self.base / "gpu" / f"{name}.json"

    def _create(self, spec: CtSpec) -> None:
        self.set_gpu(spec.name, spec.gpu)
        # nvidia-smi first: its mount point is created by an overlay on /usr/bin, which would hide
        # binds made on /usr/bin before it
        binds = {"/usr/bin/nvidia-smi": FLEET_DIR / "nvidia-smi", "/usr/bin/systemctl": FLEET_DIR / "systemctl",
                 "/usr/bin/journalctl": FLEET_DIR / "journalctl", f"{EMU_LIB}/emu": FLEET_DIR / "emu",
                 "/var/log/ddt-emu/nvidia-smi.json": self.scenario_file(spec.name),
                 "/etc/systemd/system.conf": self.manager_conf()}
        for path in (Path(sys.base_prefix), CACHE):
            if path.is_dir():
                binds[str(path)] = self._stage(path) if _private(str(path)) else path
        config = {}
        if spec.weights == "shared":
            node_dir = self.models_root(spec.node) / SHARED_MODEL
            node_dir.mkdir(parents=True, exist_ok=True)
            config["mp0"] = f"{node_dir},mp=/srv/models/{SHARED_MODEL},ro=1"
        self.nodes[spec.node].create_container(spec.vmid, spec.name, binds=binds, config=config)

    def share_wheel_cache(self) -> None:
        """ddtctl's server-wheel cache ($DDTCTL_HOME/cache/wheels, keyed by the source identity) is
        this process's (tests/fleet/node.py fleet_base), shared by its fleets: one `pip wheel` per
        snapshot content instead of one per fleet. A fleet deploying other sources builds its own."""
        wheels = self.home / "cache" / "wheels"
        if not wheels.exists() and not wheels.is_symlink():
            shared = fleet_base() / "wheels"
            shared.mkdir(exist_ok=True)
            wheels.parent.mkdir(parents=True, exist_ok=True)
            wheels.symlink_to(shared, target_is_directory=True)

    def manager_conf(self) -> Path:
        """The containers' /etc/systemd/system.conf: its DefaultEnvironment= hands the test run's
        OMP_NUM_THREADS (tests/conftest.py) to every service, as systemd hands its own to units."""
        path = self.base / "system.conf"
        threads = os.environ.get("OMP_NUM_THREADS")
        path.write_text("[Manager]\n" + (f"DefaultEnvironment=OMP_NUM_THREADS={threads}\n" if threads else ""))
        return path

    def _stage(self, path: Path) -> Path:
        """A read-only host bind of `path` under the fleet dir (see the module docstring)."""
        stage = self.base / "stage" / str(path).strip("/").replace("/", "_")
        if stage not in self.staged:
            stage.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "--bind", str(path), str(stage)], check=True)
            self.staged.append(stage)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(stage)], check=True)
        return stage

    def set_gpu(self, name: str, scenario: str | dict) -> None:
        """Write (in place: the file is bind-mounted) the nvidia-smi scenario of container `name`."""
        path = self.scenario_file(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
        with open(path, "w") as fh:
            json.dump(data, fh)

    def inventory_doc(self) -> dict:
        nodes = {name: {"address": "127.0.0.1", "port": node.sshd.port, "user": "root",
                        "models_root": str(self.models_root(name)),
                        "ssh_options": {"IdentityFile": str(fleet_base() / "id_ed25519"),
                                        "UserKnownHostsFile": str(self.known_hosts),
                                        "StrictHostKeyChecking": "yes"}}
                 for name, node in self.nodes.items()}
        containers = {}
        for s in self.specs.values():
            service = {"kind": "ddtree", "port": s.port, "bind": "127.0.0.1", "unit": s.unit, "device": "cpu",
                       "dtype": "fp32", "python": sys.executable, "ready_timeout_s": 600,
                       "packages": {"mode": "system"}, **s.extra}     # deps: this Python's, bound in
            if s.weights == "push":
                gguf = default_gguf()
                service.update(weights="push", model_id=SHARED_MODEL,
                               target={"path": f"/srv/models/{gguf.name}", "source": str(gguf)})
            elif s.weights == "shared":
                service.update(weights="shared", target={"path": f"/srv/models/{SHARED_MODEL}",
                                                          "source": str(hf_folder())})
            containers[s.name] = {"vmid": s.vmid, "node": s.node, "address": "127.0.0.1",
                                  "groups": ["fleet"], "service": service}
        return {"nodes": nodes, "containers": containers}

    # ---- use -----------------------------------------------------------------------------------
    def env(self) -> dict:
        """Environment for running ddtctl against this fleet (hermetic ssh config and state dir)."""
        return {**os.environ, "DDTCTL_INVENTORY": str(self.inventory), "DDTCTL_SSH_CONFIG": str(self.ssh_config),
                "DDTCTL_HOME": str(self.home), "NO_COLOR": "1", "COLUMNS": "200",
                "PYTHONPATH": str(self.base / "src"), "PYTHONSAFEPATH": "1"}

    def python(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """Python with the snapshot on its path. `python -m`/`-c` would put the working directory
        FIRST on sys.path (before PYTHONPATH): run from the fleet's base (no ddtctl/ there) with
        PYTHONSAFEPATH, so the live checkout (edited during the session) is never imported; else
        `status` would hash a changed server/ and report a version mismatch."""
        return subprocess.run([sys.executable, *args], env=self.env(), capture_output=True, cwd=self.base,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def ddtctl(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return self.python("-m", "ddtctl", *args, timeout=timeout)

    def exec(self, name: str, *argv: str) -> subprocess.CompletedProcess:
        """Run argv inside container `name` via the node's pct emulation (test inspection only)."""
        spec = self.specs[name]
        return self.nodes[spec.node].pct("exec", str(spec.vmid), "--", *argv, check=False)

    def show(self, name: str) -> dict:
        out = self.exec(name, "systemctl", "show", self.specs[name].unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, name: str, lines: int = 50) -> str:
        return self.exec(name, "journalctl", "-u", self.specs[name].unit, "-n", str(lines), "-o", "cat").stdout

    def close(self) -> None:
        for spec in self.specs.values():
            node = self.nodes.get(spec.node)
            if node and spec.vmid in node.running():
                node.pct("stop", str(spec.vmid), check=False)
        while self.staged:
            subprocess.run(["umount", "-l", str(self.staged.pop())], capture_output=True)
