"""Host lock: one ddtctl at a time changes a host's releases, weights and units.

Two operators deploying the same container at once would interleave `current` switches, unit
writes and restarts. The lock is a directory `<root>/.ddtctl.lock` made with `mkdir` without
`-p`: mkdir(2) is atomic and fails with EEXIST for every caller but one (POSIX; also over
`pct exec` and SSH, since it runs on the target). The holder writes `owner` (user@machine, pid,
command, UTC time) into it and removes the directory when it is done, also when the deploy fails
(only while the owner line is still its own: a lock broken and re-taken by another run stays).
A ddtctl that finds the lock stops at once with `HostLocked` (exit 1) naming the holder, before
changing anything; `--break-lock` removes a lock left behind by a killed run first.
Dry runs take no lock (they change nothing).
"""

from __future__ import annotations

import getpass
import os
import posixpath
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ddtctl.errors import RemoteError

LOCK_DIR = ".ddtctl.lock"


class HostLocked(RemoteError):
    """Another ddtctl holds the host's lock; the message names it and how to break a stale one."""


def lock_path(root: str) -> str:
    """The lock directory of a host whose files live under `root`."""
    return posixpath.join(root, LOCK_DIR)


def owner_line(command: str) -> str:
    """`user@machine pid N: command since 2026-11-30T05:00:00Z` (who holds the lock)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"{user}@{socket.gethostname()} pid {os.getpid()}: {command} since {stamp}"


@contextmanager
def host_lock(transport, root: str, command: str, *, break_lock: bool = False) -> Iterator[str]:
    """Hold `<root>/.ddtctl.lock` for the duration of the block; yields the lock path.

    Raises HostLocked if another holder has it (nothing changed), RemoteError if the lock cannot
    be created for another reason (e.g. `root`'s parent is not writable).
    """
    path = lock_path(root)
    transport.run(["mkdir", "-p", "--", root], timeout=60).check()
    if break_lock:
        transport.run(["rm", "-rf", "--", path], timeout=60).check()
    made = transport.run(["mkdir", "--", path], timeout=60)
    if not made.ok:
        if transport.run(["test", "-d", path], timeout=60).ok:
            holder = transport.run(["cat", "--", posixpath.join(path, "owner")], timeout=60)
            who = holder.text.strip() if holder.ok and holder.text.strip() else "an unknown holder (no owner file)"
            raise HostLocked(f"{root} is locked by {who}; if that run is gone (killed, machine "
                             f"lost), repeat with --break-lock", made)
        made.check()
    owner = owner_line(command)
    owner_file = posixpath.join(path, "owner")
    wrote = transport.run(["tee", "--", owner_file], stdin=(owner + "\n").encode(), timeout=60)
    if not wrote.ok:
        transport.run(["rm", "-rf", "--", path], timeout=60)
        wrote.check()
    try:
        yield path
    finally:
        # remove only our own lock: after someone's --break-lock, the directory may be theirs
        held = transport.run(["cat", "--", owner_file], timeout=60)
        if held.ok and held.text.strip() == owner:
            transport.run(["rm", "-rf", "--", path], timeout=60)
