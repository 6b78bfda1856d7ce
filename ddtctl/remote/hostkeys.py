"""Host-key verification with OpenSSH's rules (ssh_config(5) StrictHostKeyChecking, sshd(8)
SSH_KNOWN_HOSTS FILE FORMAT, sshconnect.c check_host_key).

The offered key is looked up under ``HostConfig.known_host_name`` (HostKeyAlias, else
``[host]:port`` or ``host``) in every UserKnownHostsFile and GlobalKnownHostsFile (plain, hashed
``|1|salt|hmac`` and wildcard/negated patterns; ``@revoked`` lines; ``@cert-authority`` lines are
skipped: host certificates are not supported). Result, as OpenSSH:

* a key in RevokedHostKeys or marked ``@revoked`` -> refused;
* an equal key anywhere -> ok;
* else a key of the same type -> CHANGED: refused with both fingerprints and the
  ``ssh-keygen -R`` command. (OpenSSH connects with ``StrictHostKeyChecking no`` but without
  port forwarding, which ddtctl needs; ddtctl always refuses.)
* else NEW: ``yes`` and ``ask`` (batch mode) refuse; ``accept-new`` and ``no`` accept it and
  append it to the FIRST user file (hashed when HashKnownHosts is yes; ``~/.ssh`` is created when
  missing, other folders are not; a file that cannot be written is reported and the connection
  proceeds, like OpenSSH). With ``UserKnownHostsFile none`` a new key cannot be recorded and is
  refused, as by OpenSSH.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import hmac
import os
import re
import shlex
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import paramiko

from ddtctl.errors import HostKeyError
from ddtctl.remote.sshconfig import HostConfig, home_dir

_append_lock = threading.Lock()


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style ``SHA256:<base64>`` fingerprint of a key."""
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).rstrip(b"=")
    return "SHA256:" + digest.decode()


def remove_hint(known_hosts: str, hostname: str) -> str:
    """The command that deletes ``hostname``'s entries from ``known_hosts``."""
    return shlex.join(["ssh-keygen", "-f", str(known_hosts), "-R", hostname])


@dataclass(frozen=True)
class Entry:
    """One known_hosts line: marker ("" | "@revoked" | "@cert-authority"), key blob, source file."""

    marker: str
    patterns: str
    blob: bytes
    path: str

    @property
    def keytype(self) -> str:
        return _blob_type(self.blob)


def _blob_type(blob: bytes) -> str:
    n = int.from_bytes(blob[:4], "big")
    return blob[4:4 + n].decode("ascii", "replace")


def _hashed_match(name: str, pattern: str) -> bool:
    try:
        _, magic, salt, digest = pattern.split("|")
        mac = hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest()
        return magic == "1" and hmac.compare_digest(mac, base64.b64decode(digest))
    except (ValueError, TypeError):
        return False


def _wildcard(name: str, pattern: str) -> bool:
    """OpenSSH match_pattern: only ``*`` and ``?`` are special (``[`` is literal)."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, name, re.S) is not None


def host_matches(name: str, patterns: str) -> bool:
    """OpenSSH match_hostname: comma-separated patterns with ``*``/``?``, ``!`` negation (a
    negated match wins), case-insensitive; a hashed field matches only its exact name."""
    if patterns.startswith("|"):
        return _hashed_match(name, patterns)
    name, found = name.lower(), False
    for pattern in patterns.lower().split(","):
        negated = pattern.startswith("!")
        if _wildcard(name, pattern[1:] if negated else pattern):
            if negated:
                return False
            found = True
    return found


def read_entries(path: str) -> Iterator[Entry]:
    """Entries of a known_hosts file (missing or unreadable files yield nothing)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return
    for line in lines:
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = fields.pop(0) if fields[0].startswith("@") else ""
        if len(fields) < 3:
            continue
        try:
            blob = base64.b64decode(fields[2], validate=True)
        except ValueError:
            continue
        yield Entry(marker, fields[0], blob, path)


def _revoked_file(path: str) -> set[bytes]:
    """Key blobs listed in a RevokedHostKeys file (public key lines). Raises HostKeyError for a
    binary KRL, which ddtctl cannot read: refusing is the safe answer."""
    try:
        data = open(path, "rb").read()
    except OSError:
        return set()
    if data.startswith(b"SSHKRL"):
        raise HostKeyError(f"RevokedHostKeys {path} is a binary KRL, which ddtctl cannot read; "
                           "refusing to connect")
    blobs = set()
    for line in data.decode("utf-8", "replace").splitlines():
        fields = line.split()
        for i, word in enumerate(fields[:-1]):
            if "ssh-" in word or word.startswith(("ecdsa-", "sk-")):
                try:
                    blobs.add(base64.b64decode(fields[i + 1], validate=True))
                except ValueError:
                    pass
                break
    return blobs


def known_types(cfg: HostConfig) -> list[str]:
    """Key types already known for the host (asked for first in key exchange, like OpenSSH)."""
    types: list[str] = []
    for entry in _entries(cfg):
        if not entry.marker and host_matches(cfg.known_host_name, entry.patterns) \
                and entry.keytype not in types:
            types.append(entry.keytype)
    return types


def _entries(cfg: HostConfig) -> Iterator[Entry]:
    for path in (*cfg.user_known_hosts, *cfg.global_known_hosts):
        yield from read_entries(path)


def verify(cfg: HostConfig, key: paramiko.PKey, notify: Callable[[str], None] | None = None) -> str:
    """Check ``key`` offered by ``cfg``'s host; returns "ok" or "added" ("new" when accepted but
    the first file could not be written). Raises HostKeyError (exit 3) where OpenSSH would refuse
    to connect."""
    name, blob, label = cfg.known_host_name, key.asbytes(), f"{key.get_name()} {fingerprint(key)}"
    if cfg.revoked_host_keys and blob in _revoked_file(cfg.revoked_host_keys):
        raise HostKeyError(f"host key of {name} ({label}) is revoked in {cfg.revoked_host_keys}")
    same_type: Entry | None = None
    found = False
    for entry in _entries(cfg):
        if entry.marker == "@cert-authority" or not host_matches(name, entry.patterns):
            continue
        if entry.marker == "@revoked":
            if entry.blob == blob:
                raise HostKeyError(f"host key of {name} ({label}) is marked @revoked in {entry.path}")
            continue
        if entry.blob == blob:
            found = True
        elif entry.keytype == _blob_type(blob) and same_type is None:
            same_type = entry
    if found:
        return "ok"
    if same_type is not None:
        known = paramiko.PKey.from_type_string(same_type.keytype, same_type.blob)
        raise HostKeyError(
            f"HOST KEY CHANGED for {name}: it offered {label}, known is {same_type.keytype} "
            f"{fingerprint(known)} ({same_type.path}). This can be a man-in-the-middle attack; "
            f"refusing to connect. If the host was reinstalled, remove the old key with: "
            f"{remove_hint(same_type.path, name)}")
    if cfg.strict in ("yes", "ask"):
        files = " ".join(cfg.user_known_hosts + cfg.global_known_hosts) or "(no known_hosts files)"
        why = ("StrictHostKeyChecking is yes" if cfg.strict == "yes" else
               "StrictHostKeyChecking is ask (OpenSSH's default), which a batch tool treats as yes")
        raise HostKeyError(
            f"host key of {name} ({label}) is not in {files} and {why}: check the fingerprint, then "
            f"add it (e.g. connect once with `ssh {cfg.name}`), or set StrictHostKeyChecking "
            f"accept-new for this host in the ssh config or the inventory's ssh_options")
    if not cfg.user_known_hosts:
        raise HostKeyError(f"host key of {name} ({label}) is not known and UserKnownHostsFile is none, "
                           f"so it cannot be recorded: OpenSSH refuses such a host, and so does ddtctl")
    return _add(cfg, name, key, notify)


def _add(cfg: HostConfig, name: str, key: paramiko.PKey, notify: Callable[[str], None] | None) -> str:
    path = cfg.user_known_hosts[0]
    stored = paramiko.HostKeys.hash_host(name) if cfg.hash_known_hosts else name
    line = f"{stored} {key.get_name()} {key.get_base64()}\n"
    try:
        parent = os.path.dirname(path)
        if parent == os.path.join(home_dir(), ".ssh") and not os.path.isdir(parent):
            os.mkdir(parent, 0o700)                     # OpenSSH creates ~/.ssh, nothing else
        with _append_lock, open(path, "a", encoding="ascii") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            if fh.tell() > 0 and not _ends_with_newline(path):
                fh.write("\n")
            fh.write(line)
            fh.flush()
            if os.path.isfile(path):
                os.fsync(fh.fileno())
    except OSError as exc:
        if notify:
            notify(f"warning: could not add the host key of {name} to {path}: {exc.strerror or exc}")
        return "new"
    if notify:
        notify(f"permanently added the {key.get_name()} host key of {name} ({fingerprint(key)}) to {path}")
    return "added"


def _ends_with_newline(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) == b"\n"
    except OSError:
        return True
