"""UnitState: what a service manager says about a service, and the parsers that build it (pure).

Sources: `systemctl show -p LoadState,ActiveState,SubState,Result,NRestarts,MainPID` (systemctl(1);
a unit systemd has no file for still answers, exit 0, with `LoadState=not-found` and
`ActiveState=inactive`: `installed` is False then) and
systemd's journal messages for the start rate limit (systemd.unit(5) StartLimitIntervalSec=,
StartLimitBurst=).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class UnitState:
    """Service state. active: active | activating | deactivating | reloading | inactive | failed | unknown.

    start_limit_hit: the start rate limit refused the last start (systemd.unit(5)
    StartLimitIntervalSec=/StartLimitBurst=). systemd 252 keeps an earlier failure's Result= then
    (e.g. exit-code) and only says so in the journal, so `SystemdManager.diagnose()` also reads
    the journal; `state()` alone sees it only when Result=start-limit-hit."""

    active: str
    sub: str = ""
    result: str = ""
    restarts: int = 0
    pid: int | None = None
    start_limit_hit: bool = False
    load: str = "loaded"            # LoadState: loaded | not-found | bad-setting | error | masked

    @property
    def installed(self) -> bool:
        """False for a unit systemd does not know (`LoadState=not-found`: no unit file)."""
        return self.load != "not-found"

    @property
    def failed(self) -> bool:
        return self.active == "failed" or self.result == "start-limit-hit"

    def describe(self) -> str:
        """`active (running)`, `failed (Result: exit-code; start limit hit)`, ... (one line)."""
        notes = [f"Result: {self.result}"] if self.result not in ("", "success") else []   # start-limit-hit too
        if self.start_limit_hit and self.result != "start-limit-hit":
            notes.append("start limit hit")
        if self.restarts:
            notes.append(f"{self.restarts} automatic restart{'s' if self.restarts != 1 else ''}")
        if not self.installed:
            return "not installed (LoadState=not-found)"
        if self.load not in ("", "loaded"):
            notes.insert(0, f"LoadState: {self.load}")
        sub = f" ({self.sub})" if self.sub and self.sub != self.active else ""
        return f"{self.active}{sub}" + (f" [{'; '.join(notes)}]" if notes else "")

    def to_dict(self) -> dict:
        return {**asdict(self), "failed": self.failed, "installed": self.installed,
                "description": self.describe()}


def start_limit_in_journal(text: str, unit: str) -> bool:
    """True when systemd's "UNIT: Start request repeated too quickly." comes after the unit's
    last start ("Starting ...") in `journal_argv` output (`-o cat`)."""
    hit = f"{unit}: Start request repeated too quickly."
    for line in reversed(text.splitlines()):
        if line.strip() == hit:
            return True
        if line.startswith("Starting ") and line.rstrip().endswith("..."):
            return False
    return False


def parse_show(text: str) -> UnitState:
    """UnitState from `systemctl show -p ...` output (KEY=VALUE lines, any order)."""
    props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    pid = props.get("MainPID", "0")
    restarts = props.get("NRestarts", "0")
    return UnitState(active=props.get("ActiveState") or "unknown", sub=props.get("SubState", ""),
                     result=props.get("Result", ""), restarts=int(restarts) if restarts.isdigit() else 0,
                     pid=int(pid) if pid.isdigit() and int(pid) > 0 else None,
                     start_limit_hit=props.get("Result") == "start-limit-hit",
                     load=props.get("LoadState") or "loaded")
