"""Host-key checking for SSH connections: ``accept-new`` (default) and ``strict``.

Fabric installs Paramiko's AutoAddPolicy (accepts anything, remembers nothing; ops.md §2.3). ddtctl
instead loads ``/etc/ssh/ssh_known_hosts`` and the user's known_hosts file (default
``~/.ssh/known_hosts``, hashed entries included) into every client, then:

* accept-new (OpenSSH ``StrictHostKeyChecking accept-new``): an unknown host's key is accepted and
  appended to the known_hosts file (one line, under an flock); a CHANGED key is refused;
* strict (``StrictHostKeyChecking yes``): unknown hosts are refused too.

A changed key is detected by Paramiko (BadHostKeyException) and reported as HostKeyError with the
``ssh-keygen -R`` command that removes the stale entry (the pyinfra UX, ops.md §2.2).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import shlex
import threading
from pathlib import Path

import paramiko

from ddtctl.errors import HostKeyError

POLICIES = ("accept-new", "strict")
SYSTEM_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")
_append_lock = threading.Lock()


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style ``SHA256:<base64>`` fingerprint of a key."""
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).rstrip(b"=")
    return "SHA256:" + digest.decode()


def remove_hint(known_hosts: Path, hostname: str) -> str:
    """The command that deletes ``hostname``'s entries from ``known_hosts``."""
    return shlex.join(["ssh-keygen", "-f", str(known_hosts), "-R", hostname])


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    def __init__(self, known_hosts: Path):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        path = self.known_hosts
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with _append_lock, open(path, "a", encoding="ascii") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())
        client.get_host_keys().add(hostname, key.get_name(), key)


class _Strict(paramiko.MissingHostKeyPolicy):
    def __init__(self, known_hosts: Path):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        raise HostKeyError(
            f"host key of {hostname} ({key.get_name()} {fingerprint(key)}) is not in "
            f"{self.known_hosts} and strict host key checking is on; verify it and add it, or "
            f"connect once with the accept-new policy")


def prepare_client(client: paramiko.SSHClient, policy: str, known_hosts: Path) -> None:
    """Load known hosts into ``client`` and install the ``policy`` ("accept-new" | "strict").

    Raises ValueError for an unknown policy name."""
    if policy not in POLICIES:
        raise ValueError(f"host key policy must be one of {POLICIES}, got {policy!r}")
    if SYSTEM_KNOWN_HOSTS.is_file():
        client.load_system_host_keys(str(SYSTEM_KNOWN_HOSTS))
    if known_hosts.is_file():
        client.load_host_keys(str(known_hosts))
    cls = _AcceptNew if policy == "accept-new" else _Strict
    client.set_missing_host_key_policy(cls(known_hosts))


def changed_key_error(exc: paramiko.BadHostKeyException, hostname: str, port: int,
                      known_hosts: Path) -> HostKeyError:
    """HostKeyError for a key that differs from the known one, with the removal command."""
    name = hostname if port == 22 else f"[{hostname}]:{port}"
    return HostKeyError(
        f"HOST KEY CHANGED for {name}: it offered {exc.key.get_name()} {fingerprint(exc.key)}, "
        f"known is {exc.expected_key.get_name()} {fingerprint(exc.expected_key)}. This can be a "
        f"man-in-the-middle attack; refusing to connect. If the host was reinstalled, remove the "
        f"old key with: {remove_hint(known_hosts, name)}")
