"""Where the emulations keep unit files, runtime state and journals.

Real systemd reads units from /etc/systemd/system (systemd.unit(5) "Unit File Load Path") and keeps
its runtime state in PID 1's memory; the persistent journal lives in /var/log/journal. The emulation
keeps the same unit directory and puts its state and per-unit journals under /var/log/ddt-emu:
both are container-private, writable directories in the pct emulation (tests/fleet/pctemu/ns.py
PRIVATE_DIRS). The nvidia-smi scenario is read from /var/log/ddt-emu/nvidia-smi.json, which the
fleet fixtures bind (read-only) into each container.

Everything is relative to a root: `/` inside a test container (the container's mount namespace
provides the private views), or `$DDT_EMU_ROOT` when the tools run standalone in unit tests.
`pct exec ... env -i` clears the environment, so inside containers the root is always `/`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT_ENV = "DDT_EMU_ROOT"


@dataclass(frozen=True)
class Paths:
    root: Path

    @classmethod
    def from_env(cls) -> "Paths":
        return cls(Path(os.environ.get(ROOT_ENV) or "/"))

    def _p(self, rel: str) -> Path:
        return self.root / rel

    @property
    def unit_dir(self) -> Path:
        """Real location of administrator units (systemd.unit(5))."""
        return self._p("etc/systemd/system")

    @property
    def manager_conf(self) -> Path:
        """systemd-system.conf(5): the manager's settings (DefaultEnvironment=, proc.py)."""
        return self._p("etc/systemd/system.conf")

    @property
    def emu_dir(self) -> Path:
        return self._p("var/log/ddt-emu")

    @property
    def state_dir(self) -> Path:
        """Per-unit state JSON, loaded-unit snapshots, locks and notify sockets."""
        return self.emu_dir / "systemd"

    @property
    def journal_dir(self) -> Path:
        """One JSON-lines journal file per unit, read by the journalctl emulation."""
        return self.emu_dir / "journal"

    @property
    def nvidia_scenario(self) -> Path:
        return self.emu_dir / "nvidia-smi.json"

    def state_file(self, unit: str) -> Path:
        return self.state_dir / f"{unit}.state.json"

    def loaded_file(self, unit: str) -> Path:
        return self.state_dir / f"{unit}.loaded.json"

    def lock_file(self, unit: str) -> Path:
        return self.state_dir / f"{unit}.lock"

    def ratelimit_file(self, unit: str) -> Path:
        """The unit's start rate-limit window (ratelimit.py)."""
        return self.state_dir / f"{unit}.ratelimit.json"

    def notify_socket(self, unit: str) -> str:
        """A filesystem socket path when it fits in sun_path (108 bytes), else an abstract one.

        sd_notify(3) accepts both: NOTIFY_SOCKET starting with `@` names an abstract socket.
        """
        path = str(self.state_dir / f"{unit}.notify")
        if len(path.encode()) < 100:
            return path
        import hashlib

        return "@ddt-emu-notify-" + hashlib.sha1(path.encode()).hexdigest()[:16]

    def journal_file(self, unit: str) -> Path:
        return self.journal_dir / f"{unit}.jsonl"

    def ensure(self) -> None:
        for d in (self.state_dir, self.journal_dir):
            d.mkdir(parents=True, exist_ok=True)
