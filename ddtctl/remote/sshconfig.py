"""What OpenSSH would use to reach a host: the ssh_config evaluated by OpenSSH itself (``ssh -G``).

``ssh -G [-F FILE] [-l USER] [-p PORT] [-J JUMPS] [-o K=V ...] HOST`` prints the configuration
``ssh`` would use for HOST after Host/Match blocks (first obtained value wins), Include, tokens
and defaults, without connecting (ssh(1), ssh_config(5)). ddtctl reads these keys from it and
nothing else decides them:

HostName, Port, User, IdentityFile (tokens ``%d %u %h %r %p %n %l %L %i %%`` and ``~`` expanded
here, as ``ssh -G`` leaves them), IdentitiesOnly, IdentityAgent (``none`` only), ProxyJump,
ProxyCommand, StrictHostKeyChecking, UserKnownHostsFile, GlobalKnownHostsFile, HostKeyAlias,
HashKnownHosts, RevokedHostKeys, ConnectTimeout, ServerAliveInterval, ServerAliveCountMax.

Precedence is OpenSSH's: command-line values first (ddtctl passes the inventory's ``user``/``port``
as ``-l``/``-p`` and its ``ssh_options`` as ``-o``), then the config file (``$DDTCTL_SSH_CONFIG``
as ``-F``, else ``~/.ssh/config`` and ``/etc/ssh/ssh_config``). ``~`` is the user's home from the
password database, as for OpenSSH. Without an ``ssh`` executable, Paramiko's parser is used
instead (no ``Include``; documented in docs/operations.md).

ddtctl's own defaults where OpenSSH has none: ConnectTimeout 10 s (OpenSSH: the TCP timeout) and
ServerAliveInterval 10 s x ServerAliveCountMax 3 (OpenSSH: off), so a silent peer is noticed
within ~30 s; ``ServerAliveInterval 0`` keeps ddtctl's default (ddtctl never waits unbounded).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from ddtctl.errors import UsageError

DEFAULT_CONNECT_TIMEOUT = 10.0   # s
DEFAULT_ALIVE_INTERVAL = 10.0    # s
DEFAULT_ALIVE_COUNT = 3
STRICT_VALUES = {"true": "yes", "yes": "yes", "false": "no", "no": "no", "off": "no",
                 "ask": "ask", "accept-new": "accept-new"}
_SSH = "ssh"


def home_dir() -> str:
    """The user's home directory as OpenSSH sees it (password database, not $HOME)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return os.path.expanduser("~")


@dataclass(frozen=True)
class HostConfig:
    """The evaluated configuration of one host (one hop). Times in seconds.

    strict: "yes" | "accept-new" | "no" | "ask" (ask is refused like yes: ddtctl is a batch tool).
    user_known_hosts: files checked, the first one is written to (empty for ``none``).
    known_host_name: the name keys are stored under: HostKeyAlias, else ``[host]:port`` (port
    other than 22) or ``host`` (sshconnect.c)."""

    name: str
    hostname: str
    port: int = 22
    user: str = "root"
    identity_files: tuple[str, ...] = ()
    identities_only: bool = False
    use_agent: bool = True
    strict: str = "ask"
    user_known_hosts: tuple[str, ...] = ()
    global_known_hosts: tuple[str, ...] = ()
    host_key_alias: str | None = None
    hash_known_hosts: bool = False
    revoked_host_keys: str | None = None
    proxy_jump: str | None = None
    proxy_command: str | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    alive_interval: float = DEFAULT_ALIVE_INTERVAL
    alive_count: int = DEFAULT_ALIVE_COUNT
    ciphers: tuple[str, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def known_host_name(self) -> str:
        if self.host_key_alias:
            return self.host_key_alias
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    @property
    def silent_after(self) -> float:
        """Seconds without an answer after which the peer counts as gone (interval x count)."""
        return self.alive_interval * self.alive_count

    @property
    def dest(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def expand_tokens(text: str, *, hostname: str = "", port: int = 22, user: str = "",
                  original: str = "") -> str:
    """OpenSSH percent tokens (ssh_config(5) TOKENS) and a leading ``~``.

    Raises UsageError for an unknown token."""
    local = socket.gethostname()
    values = {"%": "%", "d": home_dir(), "u": _local_user(), "h": hostname, "p": str(port), "r": user,
              "n": original or hostname, "l": local, "L": local.split(".")[0], "i": str(os.getuid())}

    def sub(m: re.Match) -> str:
        if m.group(1) not in values:
            raise UsageError(f"ssh config: unsupported token %{m.group(1)} in {text!r}")
        return values[m.group(1)]
    out = re.sub(r"%(.)", sub, text)
    if out == "~" or out.startswith("~/"):
        out = home_dir() + out[1:]
    return out


def _local_user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def ssh_argv(host: str, *, config_file: str | None, user: str | None, port: int | None,
             jump: str | None, options: Mapping[str, str]) -> list[str]:
    """``ssh -G`` argv; -l/-p come before -o so they win like on ssh's command line."""
    argv = [_SSH, "-G"]
    if config_file:
        argv += ["-F", config_file]
    if user:
        argv += ["-l", user]
    if port:
        argv += ["-p", str(port)]
    if jump:
        argv += ["-J", jump]
    for key, value in options.items():
        argv.append(f"-o{key}={value}")
    return [*argv, "--", host]


def parse_g(text: str) -> dict[str, list[str]]:
    """``ssh -G`` output -> lowercase key -> values (repeated keys such as identityfile kept)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            out.setdefault(key.lower(), []).append(value.strip())
    return out


def _seconds(value: str | None, default: float) -> float:
    if not value or value == "none":
        return default
    try:
        seconds = float(value)
    except ValueError:
        return default
    return seconds if seconds > 0 else default


def from_values(name: str, values: Mapping[str, list[str]]) -> HostConfig:
    """HostConfig from evaluated values (``parse_g`` output, or the Paramiko fallback's)."""
    one = {k: v[0] for k, v in values.items() if v}
    hostname, user = one.get("hostname", name), one.get("user") or _local_user()
    port = int(one.get("port", "22"))

    def files(key: str, default: str) -> tuple[str, ...]:
        words = " ".join(values.get(key, [default])).split()
        if words == ["none"]:
            return ()
        return tuple(expand_tokens(w, hostname=hostname, port=port, user=user, original=name) for w in words)

    identities = tuple(expand_tokens(p, hostname=hostname, port=port, user=user, original=name)
                       for p in values.get("identityfile", []))
    strict = STRICT_VALUES.get(one.get("stricthostkeychecking", "ask").lower(), "ask")
    jump = one.get("proxyjump")
    command = one.get("proxycommand")
    revoked = one.get("revokedhostkeys")
    alias = one.get("hostkeyalias")
    count = one.get("serveralivecountmax", "")
    return HostConfig(
        name=name, hostname=hostname, port=port, user=user, identity_files=identities,
        identities_only=one.get("identitiesonly", "no").lower() in ("yes", "true"),
        use_agent=one.get("identityagent", "").lower() != "none",
        strict=strict,
        user_known_hosts=files("userknownhostsfile", "~/.ssh/known_hosts ~/.ssh/known_hosts2"),
        global_known_hosts=files("globalknownhostsfile", "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"),
        host_key_alias=None if alias in (None, "none") else alias,
        hash_known_hosts=one.get("hashknownhosts", "no").lower() in ("yes", "true"),
        revoked_host_keys=None if revoked in (None, "none") else expand_tokens(revoked),
        proxy_jump=None if jump in (None, "none") else jump,
        proxy_command=None if command in (None, "none") else command,
        connect_timeout=_seconds(one.get("connecttimeout"), DEFAULT_CONNECT_TIMEOUT),
        alive_interval=_seconds(one.get("serveraliveinterval"), DEFAULT_ALIVE_INTERVAL),
        alive_count=int(count) if count.isdigit() and int(count) > 0 else DEFAULT_ALIVE_COUNT,
        ciphers=tuple(c for c in one.get("ciphers", "").split(",") if c),
        raw=dict(values))


def resolve(host: str, *, config_file: str | None = None, user: str | None = None,
            port: int | None = None, jump: str | None = None,
            options: Mapping[str, str] | None = None) -> HostConfig:
    """The configuration OpenSSH would use for ``host`` (see the module docstring).

    Raises UsageError when OpenSSH rejects the configuration or an option (exit 2)."""
    options = dict(options or {})
    if shutil.which(_SSH) is None:
        return _paramiko_fallback(host, config_file=config_file, user=user, port=port, jump=jump,
                                  options=options)
    argv = ssh_argv(host, config_file=config_file, user=user, port=port, jump=jump, options=options)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"cannot evaluate the ssh configuration of {host}: {exc}") from None
    if proc.returncode != 0:
        where = f" ({config_file})" if config_file else ""
        raise UsageError(f"ssh configuration{where} for {host} is not valid: "
                         f"{proc.stderr.strip() or f'ssh -G exit {proc.returncode}'}")
    return from_values(host, parse_g(proc.stdout))


def _paramiko_fallback(host: str, *, config_file, user, port, jump, options) -> HostConfig:
    """Paramiko's ssh_config parser, used only when no OpenSSH client is installed."""
    import paramiko

    paths = [config_file] if config_file else [os.path.join(home_dir(), ".ssh", "config"), "/etc/ssh/ssh_config"]
    values: dict[str, list[str]] = {}
    for key, value in options.items():                       # command line first: it wins
        values.setdefault(key.lower(), [value])
    if user:
        values.setdefault("user", [user])
    if port:
        values.setdefault("port", [str(port)])
    if jump:
        values.setdefault("proxyjump", [jump])
    for path in paths:
        if not os.path.isfile(path):
            continue
        try:
            found = paramiko.SSHConfig.from_path(path).lookup(host)
        except Exception as exc:  # noqa: BLE001 - paramiko raises several types for a bad file
            raise UsageError(f"ssh configuration {path} is not valid: {exc}") from None
        for key, value in found.items():
            if key not in values:
                values[key] = list(value) if isinstance(value, list) else [str(value)]
    values.setdefault("hostname", [host])
    return from_values(host, values)


def parse_jump(spec: str) -> list[tuple[str | None, str, int | None]]:
    """``[user@]host[:port]`` hops of a ProxyJump value, in connection order.

    Raises UsageError for an ssh:// URI or an empty hop."""
    hops = []
    for item in spec.split(","):
        item = item.strip()
        if not item or item.startswith("ssh://"):
            raise UsageError(f"ProxyJump {spec!r}: use [user@]host[:port] hops")
        user, _, rest = item.rpartition("@")
        host, port = rest, None
        if rest.startswith("["):
            host, _, tail = rest[1:].partition("]")
            port = int(tail[1:]) if tail.startswith(":") else None
        elif rest.count(":") == 1:
            host, _, p = rest.partition(":")
            port = int(p)
        hops.append((user or None, host, port))
    return hops
