"""Fixture API for emulated Proxmox nodes: a real sshd (tests/fleet/sshd.py) whose sessions get
``PATH=<node bin dir>:<std PATH>`` and ``DDT_FAKE_PVE=<node state dir>`` via ``SetEnv``, so ``pct``
over SSH is the emulation (tests/fleet/pct, symlinked into ``node.bin_dir``) acting on this
node's containers. Symlink more node-level tools into ``node.bin_dir`` to put them on its PATH.

    node = FakeNode("pve1", workdir, client_key).start()
    node.create_container(200, "ct200", binds={"/usr/bin/systemctl": fake_systemctl})
    node.transport()                      # an SshTransport through a generated ssh config file
    node.private_path(200, "/opt/x")      # where the CT's /opt/x lives on the host
    node.close()

Container-view hook (for emulated systemctl/journalctl/nvidia-smi): ``binds`` maps a path inside
the container to a host file or directory; each becomes a raw
``lxc.mount.entry: <host> <ct path> none bind,ro,create=file|dir 0 0`` config line, bind-mounted
over the container view at every ``pct start`` (missing mount points are created without touching
the host, see pctemu/ns.py). ``add_bind`` adds one later (effective at the next start).
:func:`shared_node` returns one node per name per test process (session fixtures use it).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from ddtctl.remote.ssh import SshTransport
from tests.fleet.pctemu.ns import PRIVATE_DIRS
from tests.fleet.sshd import SSHD, SshServer, keygen, write_client_files

FLEET_DIR = Path(__file__).resolve().parent
PCT = FLEET_DIR / "pct"
STD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def fleet_available() -> str | None:
    """None when the fleet can run here, else the reason (for pytest.skip)."""
    if os.geteuid() != 0:
        return "the test fleet needs root (sshd, mount namespaces)"
    if not os.access(SSHD, os.X_OK):
        return "openssh-server is not installed (apt-get install openssh-server)"
    if not (shutil.which("unshare") and shutil.which("nsenter")):
        return "util-linux unshare/nsenter missing"
    return None


class FakeNode:
    """One emulated Proxmox node. name is also its ssh-config alias and pct node name."""

    def __init__(self, name: str, workdir: Path, client_key: Path,
                 extra_env: Mapping[str, str] | None = None):
        self.name, self.dir, self.client_key = name, Path(workdir), Path(client_key)
        self.state = self.dir / "pve"
        (self.state / "lxc").mkdir(parents=True, exist_ok=True)
        (self.state / "nodename").write_text(name + "\n")
        # unshare --mount=<file> needs the file on a private mount when / is shared (systemd hosts)
        self._private = subprocess.run(["mount", "--bind", str(self.state), str(self.state)],
                                       capture_output=True).returncode == 0
        if self._private:
            subprocess.run(["mount", "--make-private", str(self.state)], check=True)
        # SHLVL=1: bash then skips ~/.bashrc for ssh commands (bash sources it when SSH_CLIENT is
        # set and SHLVL < 2): a developer's .bashrc (pyenv init, ~0.5 s) is no part of a PVE node
        self.bin_dir = self.dir / "bin"  # first on the node's PATH; holds only `pct` (a symlink)
        self.bin_dir.mkdir(exist_ok=True)
        if not (self.bin_dir / "pct").exists():
            (self.bin_dir / "pct").symlink_to(PCT)
        self.path = f"{self.bin_dir}:{STD_PATH}"
        env = {"PATH": self.path, "DDT_FAKE_PVE": str(self.state), "SHLVL": "1",
               **(extra_env or {})}
        pub = Path(f"{client_key}.pub").read_text()
        self.sshd = SshServer(self.dir / "sshd", alias=name, client_pubkeys=[pub], setenv=env)
        self.ssh_config: Path | None = None
        self.known_hosts: Path | None = None

    def start(self) -> FakeNode:
        self.sshd.start()
        self.ssh_config, self.known_hosts = write_client_files(self.dir / "client", [self.sshd],
                                                               self.client_key)
        return self

    def transport(self, **kwargs) -> SshTransport:
        """A new SshTransport to this node (through the generated ssh config + known_hosts)."""
        opts = {"ssh_config": self.ssh_config, "known_hosts": self.known_hosts, **kwargs}
        return SshTransport(self.name, **opts)

    def pct(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run the pct emulation locally for this node (fixture set-up, not the code under test)."""
        env = {**os.environ, "DDT_FAKE_PVE": str(self.state), "PATH": self.path}
        return subprocess.run([str(PCT), *args], env=env, capture_output=True, text=True,
                              check=check, stdin=subprocess.DEVNULL)

    def create_container(self, vmid: int, name: str, *, start: bool = True,
                         binds: Mapping[str, str | Path] | None = None,
                         config: Mapping[str, str] | None = None) -> None:
        """Write /etc/pve/lxc/<vmid>.conf's emulated twin (hostname, arch, ostype, ``config``
        extras, one lxc.mount.entry per ``binds`` item) and optionally start the CT.
        Raises FileExistsError if the vmid exists on this node."""
        path = self.state / "lxc" / f"{vmid}.conf"
        if path.exists():
            raise FileExistsError(f"CT {vmid} already exists on {self.name}")
        base = {"arch": "amd64", "hostname": name, "ostype": "debian", **(config or {})}
        lines = [f"{k}: {v}" for k, v in sorted(base.items())]
        lines += [self._entry(ct, host) for ct, host in (binds or {}).items()]
        path.write_text("\n".join(lines) + "\n")
        if start:
            self.pct("start", str(vmid))

    @staticmethod
    def _entry(ct_path: str, host: str | Path) -> str:
        host = Path(host).resolve()
        kind = "dir" if host.is_dir() else "file"
        return f"lxc.mount.entry: {host} {ct_path.lstrip('/')} none bind,ro,create={kind} 0 0"

    def add_bind(self, vmid: int, ct_path: str, host: str | Path) -> None:
        """Add a bind of ``host`` over ``ct_path`` in the CT view (effective at next start)."""
        with open(self.state / "lxc" / f"{vmid}.conf", "a") as fh:
            fh.write(self._entry(ct_path, host) + "\n")

    def running(self) -> list[int]:
        return [int(p.name[2:-4]) for p in self.state.glob("ct*.mnt") if os.path.ismount(p)]

    def private_path(self, vmid: int, ct_path: str) -> Path:
        """Host path that backs ``ct_path`` when it lies in a container-private directory.
        Raises ValueError otherwise."""
        for d in PRIVATE_DIRS:
            if ct_path == d or ct_path.startswith(d + "/"):
                return self.state / f"ct{vmid}" / "private" / ct_path.lstrip("/")
        raise ValueError(f"{ct_path} is not in a container-private directory {PRIVATE_DIRS}")

    def close(self) -> None:
        for vmid in self.running():
            self.pct("stop", str(vmid), check=False)
        self.sshd.stop()
        if self._private:
            subprocess.run(["umount", "-l", str(self.state)], capture_output=True)
            self._private = False


def write_fleet_client_files(nodes: Iterable[FakeNode], directory: Path) -> tuple[Path, Path]:
    """One ssh config (a Host block per node) + known_hosts for several started nodes."""
    nodes = list(nodes)
    return write_client_files(directory, [n.sshd for n in nodes], nodes[0].client_key)


_BASE: Path | None = None
_NODES: dict[str, FakeNode] = {}


def fleet_base() -> Path:
    """A per-process temp dir holding the shared client key and the shared nodes."""
    global _BASE
    if _BASE is None:
        _BASE = Path(tempfile.mkdtemp(prefix="ddt-fleet-"))
        keygen(_BASE / "id_ed25519")
        atexit.register(close_all)
    return _BASE


def shared_node(name: str) -> FakeNode:
    """The process-wide node ``name`` (created and started on first use)."""
    if name not in _NODES:
        base = fleet_base()
        _NODES[name] = FakeNode(name, base / name, base / "id_ed25519").start()
    return _NODES[name]


def close_all() -> None:
    """Stop every shared node (containers, sshd, mounts) and delete the temp dir; idempotent."""
    global _BASE
    while _NODES:
        _NODES.popitem()[1].close()
    if _BASE is not None:
        shutil.rmtree(_BASE, ignore_errors=True)
        _BASE = None
