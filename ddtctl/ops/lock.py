"""Host lock: one ddtctl at a time changes a host's releases, weights and units.

Two operators deploying the same container at once would interleave `current` switches, unit
writes and restarts. The lock is a directory `<root>/.ddtctl.lock` made with `mkdir` without
`-p`: mkdir(2) is atomic and fails with EEXIST for every caller but one (POSIX; also over
`pct exec` and SSH, since it runs on the target). The holder writes its owner line into
`<lock>/owner` and removes the directory when it is done, also when the deploy fails (only
while the owner line is still its own: a lock broken and re-taken by another run stays).

Owner line: `user@hostname pid PID start BOOT:TICKS machine MACHINE_ID: command since UTC-time`.
`MACHINE_ID` is /etc/machine-id (this operator machine), `BOOT` the first 8 hex digits of the
kernel's boot id and `TICKS` the process start time in clock ticks since boot (proc(5) stat field
22): together they name one process, so a pid reused later (or after a reboot) is never mistaken
for the owner.

A ddtctl that finds the lock decides:

* the owner line names THIS machine (same machine id and hostname) and that process no longer
  exists (no such pid, another start time, or another boot): the lock is STALE. It is taken over
  safely: `mkdir <lock>/.takeover` (atomic: one taker wins), the owner line is read again and must
  still be the stale one, then our owner line replaces it and `.takeover` is removed; `note()` says
  whose stale lock was taken over.
* anything else (another machine, a live process, an old-format or missing owner line, no
  machine id here): `HostLocked` (exit 1) naming the holder, before anything changed;
  `--break-lock` removes the lock first.

Release: when the host cannot be reached any more (a node that went silent), the lock cannot be
removed; the error in flight gets a line saying the lock was left behind and that the next ddtctl
run on this machine takes it over as stale. Release runs shielded from Ctrl-C (cancel.py).
Dry runs take no lock (they change nothing).
"""

from __future__ import annotations

import getpass
import os
import posixpath
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ddtctl import cancel
from ddtctl.errors import DdtctlError, RemoteError

LOCK_DIR = ".ddtctl.lock"
TIMEOUT = 60.0  # s for each lock command
_OWNER = re.compile(r"^(?P<user>[^@\s]+)@(?P<host>\S+) pid (?P<pid>\d+)"
                    r"(?: start (?P<start>[0-9a-f]+:\d+))?(?: machine (?P<machine>[0-9a-f]+))?: "
                    r"(?P<command>.*) since (?P<since>\S+)$")


class HostLocked(RemoteError):
    """Another ddtctl holds the host's lock; the message names it and how to break a stale one."""


def lock_path(root: str) -> str:
    """The lock directory of a host whose files live under `root`."""
    return posixpath.join(root, LOCK_DIR)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def machine_id() -> str | None:
    """This machine's id (machine-id(5)), None where there is none (e.g. macOS)."""
    text = _read("/etc/machine-id") or _read("/var/lib/dbus/machine-id")
    return text if text and re.fullmatch(r"[0-9a-f]{32}", text) else None


def process_start(pid: int) -> str | None:
    """`BOOT:TICKS` of a live process of this machine, None when there is none (or no /proc)."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    stat = _read(f"/proc/{pid}/stat")
    if not boot or not stat:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return f"{boot.replace('-', '')[:8]}:{fields[19]}"


def owner_line(command: str) -> str:
    """Who holds the lock (see the module docstring for the format)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    start, machine = process_start(os.getpid()), machine_id()
    ident = (f" start {start}" if start else "") + (f" machine {machine}" if machine and start else "")
    return f"{user}@{socket.gethostname()} pid {os.getpid()}{ident}: {command} since {stamp}"


@dataclass(frozen=True)
class Verdict:
    stale: bool
    why: str


def judge(owner: str | None) -> Verdict:
    """Is the lock with this owner line stale (its owner a process of this machine that is gone)?"""
    if not owner:
        return Verdict(False, "an unknown holder (no owner file)")
    m = _OWNER.match(owner)
    if not m or not m["start"] or not m["machine"]:
        return Verdict(False, owner)
    if m["machine"] != machine_id() or m["host"] != socket.gethostname():
        return Verdict(False, f"{owner} (another machine)")
    now = process_start(int(m["pid"]))
    if now == m["start"]:
        return Verdict(False, f"{owner} (still running)")
    gone = "no longer exists" if now is None else "no longer exists (its pid now belongs to another process)"
    return Verdict(True, f"{owner}: that process of this machine {gone}")


class _Lock:
    def __init__(self, transport, root: str):
        self.t, self.root, self.path = transport, root, lock_path(root)
        self.owner_file = posixpath.join(self.path, "owner")

    def run(self, argv: list[str], **kw):
        return self.t.run(argv, timeout=TIMEOUT, **kw)

    def owner(self) -> str | None:
        res = self.run(["cat", "--", self.owner_file])
        return res.text.strip() or None if res.ok else None

    def write_owner(self, line: str) -> None:
        wrote = self.run(["tee", "--", self.owner_file], stdin=(line + "\n").encode())
        wrote.check()

    def take_over(self, stale: str, mine: str) -> bool:
        """Replace the stale owner line by ours under `<lock>/.takeover`; False if we lost."""
        guard = posixpath.join(self.path, ".takeover")
        if not self.run(["mkdir", "--", guard]).ok:
            return False
        try:
            if self.owner() != stale:
                return False
            self.write_owner(mine)
            return True
        finally:
            self.run(["rmdir", "--", guard])


@contextmanager
def host_lock(transport, root: str, command: str, *, break_lock: bool = False,
              note: Callable[[str], None] | None = None) -> Iterator[str]:
    """Hold `<root>/.ddtctl.lock` for the duration of the block; yields the lock path.

    note(text): told when a stale lock was taken over. Raises HostLocked if another holder has
    it (nothing changed), RemoteError if the lock cannot be created for another reason (e.g.
    `root`'s parent is not writable), UnreachableError when the host cannot be reached."""
    lock = _Lock(transport, root)
    lock.run(["mkdir", "-p", "--", root]).check()
    if break_lock:
        lock.run(["rm", "-rf", "--", lock.path]).check()
    mine = owner_line(command)
    made = lock.run(["mkdir", "--", lock.path])
    if made.ok:
        try:
            lock.write_owner(mine)
        except DdtctlError:
            lock.run(["rm", "-rf", "--", lock.path])
            raise
    elif lock.run(["test", "-d", lock.path]).ok:
        holder = lock.owner()
        verdict = judge(holder)
        if not verdict.stale:
            raise HostLocked(f"{root} is locked by {verdict.why}; if that run is gone (killed, machine "
                             f"lost), repeat with --break-lock", made)
        if not lock.take_over(holder, mine):
            raise HostLocked(f"{root} is locked: another ddtctl is taking over the stale lock of "
                             f"{holder}", made)
        if note:
            note(f"took over the stale lock of {verdict.why}")
    else:
        made.check()
    try:
        yield lock.path
    except BaseException as exc:
        with cancel.shielded():
            _release(lock, mine, exc)
        raise
    with cancel.shielded():
        _release(lock, mine, None)


def _release(lock: _Lock, mine: str, in_flight: BaseException | None) -> None:
    """Remove the lock if it is still ours (see the module docstring for an unreachable host)."""
    try:
        if lock.owner() == mine:
            lock.run(["rm", "-rf", "--", lock.path])
    except DdtctlError as exc:
        left = (f"the host lock {lock.path} was left behind ({str(exc).splitlines()[0]}); the next "
                f"ddtctl run on this machine takes it over as stale (or use --break-lock)")
        if isinstance(in_flight, DdtctlError) and in_flight.args and isinstance(in_flight.args[0], str):
            in_flight.args = (f"{in_flight.args[0]}\n{left}", *in_flight.args[1:])
            return
        if in_flight is not None:
            return                                   # keep the error in flight
        raise type(exc)(f"{exc}\n{left}") from None
