"""Open an authenticated Paramiko transport the way ssh(1) would, from a :class:`HostConfig`.

1. The byte stream: a TCP connection to HostName:Port (ConnectTimeout), a ``direct-tcpip`` channel
   through the last ProxyJump hop (each hop is itself connected with this function; as in ssh.c
   the last hop is resolved with ``-J <earlier hops>`` and the hop's own ssh_config, without the
   target's command-line options), or a ProxyCommand (tokens ``%h %p %r %n %%``).
2. Key exchange within ConnectTimeout (banner and handshake), preferring the key types already
   known for the host; then the host key is verified (remote/hostkeys.py) BEFORE any
   authentication is attempted.
3. Public-key authentication, within ConnectTimeout: the IdentityFile keys (with their
   ``-cert.pub``), then the ssh-agent's keys unless IdentitiesOnly is yes or IdentityAgent none.
   Passphrase-protected files are skipped (batch mode: no prompt; load them into ssh-agent).

Errors: ConnectFailed (``silent`` when the peer did not answer in time), HostKeyError,
UnreachableError for an authentication failure.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import paramiko

from ddtctl.errors import UnreachableError
from ddtctl.remote import hostkeys
from ddtctl.remote.sshconfig import HostConfig, parse_jump

Resolver = Callable[..., HostConfig]     # resolve(host, user=, port=, jump=) -> HostConfig


class ConnectFailed(Exception):
    """The byte stream or the key exchange failed; ``silent`` when the peer never answered within
    ConnectTimeout (the message then reads "<what> <destination>")."""

    def __init__(self, message: str, silent: bool = False):
        super().__init__(message)
        self.silent = silent


def open_chain(cfg: HostConfig, resolve: Resolver, notify: Callable[[str], None] | None = None
               ) -> list[tuple[paramiko.Transport, HostConfig]]:
    """Authenticated ``(transport, config)`` of ``[first hop, ..., target]`` (close them in
    reverse order). On failure everything opened so far is closed before the error propagates."""
    chain: list[tuple[paramiko.Transport, HostConfig]] = []
    try:
        if cfg.proxy_jump:
            hops = parse_jump(cfg.proxy_jump)
            user, host, port = hops[-1]
            earlier = ",".join(_hop_text(h) for h in hops[:-1]) or None
            chain = open_chain(resolve(host, user=user, port=port, jump=earlier), resolve, notify)
            sock = _through(chain[-1][0], cfg)
        elif cfg.proxy_command:
            sock = paramiko.ProxyCommand(_proxy_command(cfg))
        else:
            sock = _tcp(cfg)
        chain.append((handshake(sock, cfg, notify), cfg))
        return chain
    except BaseException:
        for t, _ in reversed(chain):
            t.close()
        raise


def _hop_text(hop: tuple[str | None, str, int | None]) -> str:
    user, host, port = hop
    text = f"[{host}]" if ":" in host else host
    return f"{user + '@' if user else ''}{text}{f':{port}' if port else ''}"


def _proxy_command(cfg: HostConfig) -> str:
    values = {"h": cfg.hostname, "p": str(cfg.port), "r": cfg.user, "n": cfg.name, "%": "%"}
    out, i, text = [], 0, cfg.proxy_command or ""
    while i < len(text):
        if text[i] == "%" and i + 1 < len(text) and text[i + 1] in values:
            out.append(values[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _tcp(cfg: HostConfig) -> socket.socket:
    try:
        return socket.create_connection((cfg.hostname, cfg.port), timeout=cfg.connect_timeout)
    except socket.gaierror as exc:
        raise UnreachableError(f"cannot resolve {cfg.hostname}: {exc.strerror or exc}") from None
    except (TimeoutError, socket.timeout):
        raise ConnectFailed("no TCP connection to", silent=True) from None
    except OSError as exc:
        raise ConnectFailed(exc.strerror or str(exc)) from None


def _through(jump: paramiko.Transport, cfg: HostConfig) -> paramiko.Channel:
    try:
        return jump.open_channel("direct-tcpip", (cfg.hostname, cfg.port), ("127.0.0.1", 0),
                                 timeout=cfg.connect_timeout)
    except (paramiko.SSHException, OSError, EOFError) as exc:
        if "Timeout" in str(exc):
            raise ConnectFailed("no channel from the jump host to", silent=True) from None
        raise ConnectFailed(f"the jump host could not open a channel: {exc}") from None


def handshake(sock, cfg: HostConfig, notify: Callable[[str], None] | None = None) -> paramiko.Transport:
    """Key exchange, host-key check and authentication on ``sock`` (see the module docstring)."""
    limit = cfg.connect_timeout
    transport = paramiko.Transport(sock)
    transport.banner_timeout = transport.handshake_timeout = transport.auth_timeout = limit
    known = hostkeys.known_types(cfg)
    opts = transport.get_security_options()
    if known:
        opts.key_types = [t for t in known if t in opts.key_types] + \
                         [t for t in opts.key_types if t not in known]
    offered = [c for c in cfg.ciphers if c in opts.ciphers]   # ssh_config Ciphers, in its order
    if offered:       # (Paramiko has no chacha20-poly1305: OpenSSH's default list gives aes128-ctr first)
        opts.ciphers = offered
    started = time.monotonic()
    try:
        try:
            transport.start_client(timeout=limit)
            key = transport.get_remote_server_key()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            waited = time.monotonic() - started
            if waited >= limit * 0.9:
                raise ConnectFailed("no SSH handshake from", silent=True) from None
            raise ConnectFailed(f"SSH handshake failed: {exc}") from None
        hostkeys.verify(cfg, key, notify)
        authenticate(transport, cfg)
        return transport
    except BaseException:
        transport.close()
        raise


def _keys(cfg: HostConfig) -> tuple[list[tuple[str, paramiko.PKey]], list[str]]:
    keys, notes = [], []
    for path in cfg.identity_files:
        if not os.path.isfile(path):
            continue
        try:
            keys.append((path, paramiko.PKey.from_path(path)))
        except paramiko.PasswordRequiredException:
            notes.append(f"{path} is passphrase-protected (add it to ssh-agent)")
        except (paramiko.SSHException, OSError, ValueError) as exc:
            notes.append(f"{path} cannot be used: {exc}")
    if cfg.use_agent and not cfg.identities_only:
        try:
            keys += [("ssh-agent", k) for k in paramiko.Agent().get_keys()]
        except paramiko.SSHException as exc:
            notes.append(f"ssh-agent: {exc}")
    return keys, notes


def authenticate(transport: paramiko.Transport, cfg: HostConfig) -> None:
    """Public-key authentication as ``cfg.user``. Raises UnreachableError (exit 3) listing what
    was tried when no key is accepted."""
    keys, notes = _keys(cfg)
    for _label, key in keys:
        try:
            transport.auth_publickey(cfg.user, key)
        except paramiko.BadAuthenticationType:
            break                                  # the server takes no public keys at all
        except paramiko.AuthenticationException:
            continue
        except (paramiko.SSHException, OSError, EOFError) as exc:
            if "timeout" in str(exc).lower():
                raise ConnectFailed("no authentication answer from", silent=True) from None
            raise ConnectFailed(f"authentication did not complete: {exc}") from None
        if transport.is_authenticated():
            return
    tried = ", ".join(label for label, _ in keys) or "no usable key (IdentityFile, ssh-agent)"
    extra = f"; {'; '.join(notes)}" if notes else ""
    raise UnreachableError(f"authentication failed for {cfg.dest} (tried {tried}){extra}")
