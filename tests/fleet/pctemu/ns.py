"""Container filesystem views for the pct emulation: one persistent mount namespace per CT.

``pct start`` runs ``unshare --mount=<state>/ct<vmid>.mnt --propagation private <this setup>``;
inside the new namespace the setup bind-mounts container-private directories (PRIVATE_DIRS,
stored under ``<state>/ct<vmid>/private``) over the host paths, applies ``mpN`` and
``lxc.mount.entry`` binds from the config, then remounts ``/`` read-only. The rest of the host
tree stays visible read-only (a documented difference from a real CT, which has its own rootfs).
``pct exec`` enters with ``nsenter --mount=<file>``; push/pull copy from a forked child that
``setns()``-es into the namespace, like pct's worker.

Mount points that do not exist are created: under a private dir directly; elsewhere by
overlaying the nearest existing ancestor with an upper dir on a per-CT tmpfs, so the host tree is
not modified (e.g. ``/usr/bin/nvidia-smi``). Exceptions, created EMPTY ON THE HOST because ``/``
itself cannot be overlaid: PRIVATE_DIRS missing on the host, and top-level mount points such as
``mp=/models`` (prefer a path under /srv or /opt in tests).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

from .state import Die, State

PRIVATE_DIRS = ("/opt", "/srv", "/etc/systemd/system", "/etc/ddtree", "/var/log",
                "/var/lib/ddtree", "/root", "/run/ddt", "/tmp", "/var/tmp")
CLONE_NEWNS = 0x00020000


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode:
        raise Die(f"pct emulation: mount {' '.join(args)} failed: {proc.stderr.strip()}")


def _nsfs_mounts() -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, rest = line.partition(" - ")
        if rest.split()[0] == "nsfs":
            out.append(fields.split()[4].encode().decode("unicode_escape"))
    return out


class _Setup:
    """Runs inside the fresh namespace (see module docstring)."""

    def __init__(self, st: State, vmid: int):
        self.st, self.vmid = st, vmid
        self.private = st.ct_dir(vmid) / "private"
        self.ovl = st.ct_dir(vmid) / "ovl"
        self.overlays: list[Path] = []

    def run(self) -> None:
        for target in _nsfs_mounts():  # copies of other CTs' namespaces: do not keep them alive
            subprocess.run(["umount", "-l", target], capture_output=True)
        self.ovl.mkdir(parents=True, exist_ok=True)
        _mount("-t", "tmpfs", "-o", "size=16m,mode=700", "ddt-ovl", str(self.ovl))
        # dirs that contain the state dir (e.g. /tmp) are covered last: their sources live there
        root = str(self.st.root.resolve()) + "/"
        late = [d for d in PRIVATE_DIRS if root.startswith(d + "/")]
        self.private_binds([d for d in PRIVATE_DIRS if d not in late])
        for key, value in self.st.read_config(self.vmid):
            if key.startswith("mp") and key[2:].isdigit():
                host, *opts = value.split(",")
                kv = dict(o.split("=", 1) for o in opts if "=" in o)
                self.bind(host, kv["mp"], ro=kv.get("ro") == "1", create="dir")
            elif key == "lxc.mount.entry":
                host, target, _fs, options = value.split()[:4]
                flags = options.split(",")
                create = next((f.split("=")[1] for f in flags if f.startswith("create=")), None)
                self.bind(host, "/" + target.lstrip("/"), ro="ro" in flags, create=create)
        self.private_binds(late)
        subprocess.run(["mount", "-o", "remount,bind,ro", "/"], capture_output=True)  # best effort

    def private_binds(self, dirs: list[str]) -> None:
        for d in dirs:
            src = self.private / d.lstrip("/")
            src.mkdir(parents=True, exist_ok=True)
            Path(d).mkdir(parents=True, exist_ok=True)  # host mount point (empty dir if missing)
            _mount("--bind", str(src), d)

    def bind(self, host: str, target: str, *, ro: bool, create: str | None) -> None:
        if not os.path.lexists(target):
            if create is None:
                raise Die(f"pct emulation: mount point {target} missing (use create=file|dir)")
            self._make(Path(target), create)
        _mount("--bind", host, target)
        if ro:
            _mount("-o", "remount,bind,ro", target)

    def _make(self, target: Path, kind: str) -> None:
        inside_private = any(str(target).startswith(d + "/") for d in PRIVATE_DIRS)
        anchor = target.parent
        while not anchor.exists():
            anchor = anchor.parent
        if not inside_private and anchor != Path("/") and anchor not in self.overlays:
            self.overlays.append(anchor)
            n = len(self.overlays)
            up, work = self.ovl / f"{n}.up", self.ovl / f"{n}.work"
            up.mkdir()
            work.mkdir()
            _mount("-t", "overlay", f"ddt-ovl{n}", "-o",
                   f"lowerdir={anchor},upperdir={up},workdir={work}", str(anchor))
        target.parent.mkdir(parents=True, exist_ok=True)
        if kind == "dir":
            target.mkdir(exist_ok=True)
        else:
            target.touch()


def setup(st: State, vmid: int) -> None:
    _Setup(st, vmid).run()


def start(st: State, vmid: int, script: str) -> None:
    """Create the CT's namespace; dies if already running or the setup failed."""
    if st.running(vmid):
        raise Die(f"CT {vmid} already running")
    ns = st.ns_file(vmid)
    ns.touch()
    proc = subprocess.run(["unshare", f"--mount={ns}", "--propagation", "private",
                           "/usr/bin/env", "python3", script, "__setup", str(vmid)],
                          capture_output=True, text=True)
    if proc.returncode:
        if st.running(vmid):
            subprocess.run(["umount", str(ns)], capture_output=True)
        raise Die(f"startup for container '{vmid}' failed\n{proc.stderr.strip()}")


def _members(ns_ino: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/mnt").st_ino == ns_ino:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def stop(st: State, vmid: int) -> None:
    """Kill every process in the CT's namespace (TERM, then KILL after 3 s) and drop it."""
    if not st.running(vmid):
        raise Die(f"CT {vmid} not running")
    ino = os.stat(st.ns_file(vmid)).st_ino
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        for pid in _members(ino):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while _members(ino) and time.monotonic() < deadline:
            time.sleep(0.05)
    subprocess.run(["umount", str(st.ns_file(vmid))], check=True)
    st.ns_file(vmid).unlink()


def enter(ns_file: Path) -> None:
    """setns() this (single-threaded, forked) process into the CT's mount namespace; cwd -> /."""
    fd = os.open(ns_file, os.O_RDONLY)
    if hasattr(os, "setns"):
        os.setns(fd, CLONE_NEWNS)
    else:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNS) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    os.close(fd)
    os.chdir("/")
