"""A REAL OpenSSH server on 127.0.0.1 for tests (no mocks): ``/usr/sbin/sshd -D -e -f <cfg>``.

Each :class:`SshServer` lives in its own temp dir with generated host keys, an authorized_keys
file, a pid file and a log (``sshd.log``, from ``-e``). Settings: ``ListenAddress 127.0.0.1``, a
free port, ``PermitRootLogin prohibit-password`` (keys only), ``UsePAM no`` (``yes`` only when
root's password field is locked with ``!``, which sshd refuses without PAM), ``StrictModes no``,
``Subsystem sftp internal-sftp``, and ``SetEnv`` lines (OpenSSH >= 7.8) that give each emulated
node its own environment (e.g. PATH with the pct emulation first, ``DDT_FAKE_PVE=<state dir>``).

Works as root on a fresh machine after ``apt-get install openssh-server`` (creates /run/sshd, the
privilege-separation directory, when missing). :func:`write_client_files` writes an
``~/.ssh/config``-style file and a known_hosts file for the servers, so the ssh-config code path
of the transport is exercised.

Faults (tests by class): :func:`freeze` SIGSTOPs a server's sshd processes (all of them: a frozen
node whose TCP connections stay open and whose listener still completes TCP handshakes in the
kernel; or ``sessions_only``: the per-connection processes of the sessions open now), :func:`thaw`
continues them, :func:`kill_sshd` SIGKILLs them (the peer's side of every connection closes).
:func:`with_home_ssh` runs a command in a private mount namespace whose ``~/.ssh`` (the home of
the password database, which OpenSSH uses, not $HOME) is a test directory.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

SSHD = shutil.which("sshd", path="/usr/sbin:/usr/local/sbin:/sbin") or "/usr/sbin/sshd"


def keygen(path: Path, kind: str = "ed25519") -> Path:
    """Generate an unencrypted key pair at path / path.pub; returns path."""
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", "ddtctl-test", "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _root_password_locked() -> bool:
    try:
        for line in Path("/etc/shadow").read_text().splitlines():
            if line.startswith("root:"):
                return line.split(":")[1].startswith("!")
    except OSError:
        pass
    return False


class SshServer:
    """One sshd; ``start()``/``stop()`` or use as a context manager.

    workdir: an empty directory owned by the test. client_pubkeys: authorized public key lines.
    setenv: variables sshd sets for every session (values without spaces or quotes)."""

    def __init__(self, workdir: Path, *, alias: str, client_pubkeys: Iterable[str],
                 setenv: Mapping[str, str] | None = None, log_level: str = "VERBOSE"):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.alias = alias
        self.host = "127.0.0.1"
        self.port = 0
        self.setenv = dict(setenv or {})
        self.log_level = log_level
        self.host_key = keygen(self.dir / "ssh_host_ed25519_key")
        (self.dir / "authorized_keys").write_text("".join(k.strip() + "\n" for k in client_pubkeys))
        self.proc: subprocess.Popen | None = None

    @property
    def host_key_line(self) -> str:
        """``ssh-ed25519 AAAA...`` of the server."""
        return " ".join(Path(f"{self.host_key}.pub").read_text().split()[:2])

    @property
    def known_hosts_line(self) -> str:
        return f"[{self.host}]:{self.port} {self.host_key_line}"

    @property
    def log(self) -> str:
        return (self.dir / "sshd.log").read_text(errors="replace")

    def _config(self) -> str:
        for k, v in self.setenv.items():
            if any(c in v for c in " \"'\\\n"):
                raise ValueError(f"SetEnv value of {k} must not contain spaces/quotes: {v!r}")
        lines = [
            f"Port {self.port}", f"ListenAddress {self.host}",
            f"HostKey {self.host_key}", f"PidFile {self.dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            f"UsePAM {'yes' if _root_password_locked() else 'no'}", "StrictModes no",
            "PrintMotd no", "PrintLastLog no", "UseDNS no", "AllowTcpForwarding yes",
            "MaxSessions 16", "MaxStartups 50:30:100", f"LogLevel {self.log_level}",
            "Subsystem sftp internal-sftp",
        ]
        if self.setenv:
            lines.append("SetEnv " + " ".join(f"{k}={v}" for k, v in self.setenv.items()))
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 15.0) -> SshServer:
        """Start sshd on a free port and wait until it sends its banner.
        Raises RuntimeError with the sshd log when it does not come up."""
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        for _ in range(3):  # a port picked by free_port() can be taken before sshd binds it
            self.port = free_port()
            cfg = self.dir / "sshd_config"
            cfg.write_text(self._config())
            subprocess.run([SSHD, "-t", "-f", str(cfg)], check=True, capture_output=True)
            log = open(self.dir / "sshd.log", "ab")
            self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log)
            log.close()
            if self._wait_banner(timeout):
                return self
            self.stop()
        raise RuntimeError(f"sshd did not start; log:\n{self.log}")

    def _wait_banner(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection((self.host, self.port), timeout=1) as s:
                    if s.recv(64).startswith(b"SSH-2.0-"):
                        return True
            except OSError:
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        """Terminate sshd (SIGTERM, then SIGKILL after 5 s); sessions it spawned end with it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> SshServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def ssh_config_block(self, identity: Path, *, user: str = "root",
                         extra: Mapping[str, str] | None = None) -> str:
        """A ``Host <alias>`` block for this server (HostName, Port, User, IdentityFile, ...)."""
        opts = {"HostName": self.host, "Port": str(self.port), "User": user,
                "IdentityFile": str(identity), "IdentitiesOnly": "yes", **(extra or {})}
        return f"Host {self.alias}\n" + "".join(f"    {k} {v}\n" for k, v in opts.items())


def write_client_files(directory: Path, servers: Iterable[SshServer], identity: Path, *,
                       extra: Mapping[str, Mapping[str, str]] | None = None,
                       known: bool = True) -> tuple[Path, Path]:
    """Write ``<directory>/config`` (one Host block per server, ``extra[alias]`` added to it) and
    ``<directory>/known_hosts`` (the servers' keys when ``known``, else empty).
    Returns (config path, known_hosts path)."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    servers = list(servers)
    config = directory / "config"
    config.write_text("".join(s.ssh_config_block(identity, extra=(extra or {}).get(s.alias))
                              for s in servers))
    known_hosts = directory / "known_hosts"
    known_hosts.write_text("".join(s.known_hosts_line + "\n" for s in servers) if known else "")
    return config, known_hosts


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def sshd_pids(server: SshServer, *, sessions_only: bool = False) -> list[int]:
    """The server's sshd processes: the listener and every sshd below it (not the shells and
    commands they run); ``sessions_only`` leaves the listener out."""
    if server.proc is None:
        return []
    tree, found, todo = _children(), [], [server.proc.pid]
    while todo:
        pid = todo.pop()
        if _comm(pid) == "sshd" and (pid != server.proc.pid or not sessions_only):
            found.append(pid)
        todo += tree.get(pid, [])
    return found


def freeze(server: SshServer, *, sessions_only: bool = False) -> list[int]:
    """SIGSTOP the server's sshd processes (see the module docstring); returns their pids."""
    pids = sshd_pids(server, sessions_only=sessions_only)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def thaw(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def kill_sshd(server: SshServer) -> None:
    """SIGKILL every sshd process of the server (listener included); stop() it afterwards."""
    for pid in sshd_pids(server):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def with_home_ssh(ssh_dir: Path, argv: list[str], *, env: Mapping[str, str] | None = None,
                  timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run argv with ``ssh_dir`` bind-mounted over ``~/.ssh`` in a private mount namespace."""
    home_ssh = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".ssh"
    home_ssh.mkdir(mode=0o700, exist_ok=True)
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                           str(ssh_dir), str(home_ssh), *argv], capture_output=True, text=True,
                          timeout=timeout, env=dict(env) if env is not None else None,
                          cwd=cwd or Path(__file__).resolve().parents[2], stdin=subprocess.DEVNULL)
