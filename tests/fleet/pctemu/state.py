"""Per-node state of the pct emulation, rooted at ``$DDT_FAKE_PVE``::

    nodename                  this node's name (default: the directory's name)
    lxc/<vmid>.conf           container config, ``key: value`` lines like /etc/pve/lxc/<vmid>.conf;
                              ``mpN: <host dir>,mp=<ct path>[,ro=1]`` and raw
                              ``lxc.mount.entry: <host path> <ct path> none bind[,ro][,create=file|dir] 0 0``
                              are applied at ``pct start``
    ct<vmid>/private/<dir>    storage of the container-private directories (see ns.PRIVATE_DIRS)
    ct<vmid>/ovl/             in-namespace tmpfs for overlays that create missing mount points
    ct<vmid>.mnt              the container's persistent mount namespace (an nsfs bind mount);
                              the container is "running" exactly while this is mounted
"""

from __future__ import annotations

import os
from pathlib import Path


class Die(Exception):
    """A Perl ``die`` in pct: message on stderr, exit status 255."""


class State:
    def __init__(self, root: str | Path | None = None):
        root = root or os.environ.get("DDT_FAKE_PVE")
        if not root:
            raise Die("pct emulation: DDT_FAKE_PVE is not set (no node state directory)")
        self.root = Path(root)
        (self.root / "lxc").mkdir(parents=True, exist_ok=True)

    @property
    def node(self) -> str:
        path = self.root / "nodename"
        return path.read_text().strip() if path.exists() else self.root.name

    def conf_path(self, vmid: int) -> Path:
        return self.root / "lxc" / f"{vmid}.conf"

    def ct_dir(self, vmid: int) -> Path:
        return self.root / f"ct{vmid}"

    def ns_file(self, vmid: int) -> Path:
        return self.root / f"ct{vmid}.mnt"

    def vmids(self) -> list[int]:
        return sorted(int(p.stem) for p in (self.root / "lxc").glob("*.conf") if p.stem.isdigit())

    def exists(self, vmid: int) -> bool:
        return self.conf_path(vmid).is_file()

    def read_config(self, vmid: int) -> list[tuple[str, str]]:
        """(key, value) pairs in file order; dies like pct when the CT is not on this node."""
        path = self.conf_path(vmid)
        if not path.is_file():
            raise Die(f"Configuration file 'nodes/{self.node}/lxc/{vmid}.conf' does not exist")
        pairs = []
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#") and ":" in line:
                key, _, value = line.partition(":")
                pairs.append((key.strip(), value.strip()))
        return pairs

    def write_config(self, vmid: int, pairs: list[tuple[str, str]]) -> None:
        path = self.conf_path(vmid)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(f"{k}: {v}\n" for k, v in pairs))
        tmp.replace(path)

    def update_config(self, vmid: int, changes: dict[str, str], delete: list[str]) -> None:
        """Set keys (replacing a key's lines) and delete keys; raw lxc.* keys stay in order."""
        pairs = [(k, v) for k, v in self.read_config(vmid) if k not in changes and k not in delete]
        pairs += list(changes.items())
        plain = sorted((p for p in pairs if not p[0].startswith("lxc.")), key=lambda p: p[0])
        self.write_config(vmid, plain + [p for p in pairs if p[0].startswith("lxc.")])

    def running(self, vmid: int) -> bool:
        return os.path.ismount(self.ns_file(vmid))

    def name(self, vmid: int) -> str:
        return dict(self.read_config(vmid)).get("hostname", f"CT{vmid}")
