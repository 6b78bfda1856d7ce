"""SshTransport against REAL OpenSSH servers on loopback (tests/fleet/sshd.py)."""

from __future__ import annotations

import hashlib
from contextlib import closing as _closing
import http.server
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import paramiko
import pytest

from ddtctl.errors import CommandTimeout, HostKeyError, UnreachableError
from ddtctl.remote.hostkeys import host_matches
from ddtctl.remote.ssh import SshTransport
from tests.fleet.conftest import (  # noqa: F401 - fixtures
    fleet_client_key, jump, make_node, pve1, pve1_transport)
from tests.fleet.sshd import free_port, keygen, with_home_ssh, write_client_files

pytestmark = pytest.mark.fleet


def test_exit_codes_and_separate_streams(pve1_transport):
    res = pve1_transport.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (res.exit_code, res.stdout, res.stderr, res.ok) == (3, b"out\n", b"err\n", False)
    assert res.transport == "node:pve1" and res.argv == ("sh", "-c", "echo out; echo err >&2; exit 3")
    assert pve1_transport.run(["true"]).ok


def test_ssh_config_ciphers_are_offered_in_their_order(pve1, pve1_transport):
    # OpenSSH's default list (ssh -G) starts with chacha20-poly1305, which Paramiko lacks: aes128-ctr
    assert pve1_transport.run(["true"]).ok and pve1_transport.transport().remote_cipher == "aes128-ctr"
    for ciphers in ("aes256-gcm@openssh.com,aes128-ctr", "chacha20-poly1305@openssh.com,aes128-gcm@openssh.com"):
        transport = pve1.transport(options={"Ciphers": ciphers})
        try:
            assert transport.run(["true"]).ok
            assert transport.transport().remote_cipher == ciphers.split(",")[-1 if "chacha" in ciphers else 0]
        finally:
            transport.close()


def test_stdin_bytes_and_closed_stdin(pve1_transport):
    blob = os.urandom(3 * 1024 * 1024) + b"\x00\r\n\x03\x04"
    res = pve1_transport.run(["sha256sum"], stdin=blob)
    assert res.text.split()[0] == hashlib.sha256(blob).hexdigest()
    started = time.monotonic()
    assert pve1_transport.run(["cat"], timeout=10).stdout == b""  # stdin closed at once: no hang
    assert time.monotonic() - started < 5


def test_no_pty_and_env(pve1_transport):
    res = pve1_transport.run(["sh", "-c", 'test -t 0 || echo notty; echo "$X"'],
                             env={"X": "a 'b' $c"})
    assert res.stdout == b"notty\na 'b' $c\n"


def test_timeout_raises_with_partial_output(pve1_transport):
    started = time.monotonic()
    with pytest.raises(CommandTimeout) as info:
        pve1_transport.run(["sh", "-c", "echo begun; exec sleep 30"], timeout=1.0)
    assert time.monotonic() - started < 5
    assert info.value.result.stdout == b"begun\n" and info.value.exit_code == 1


def test_parallel_channels_share_one_connection_at_most_8_at_once(pve1_transport,
                                                                  pve1):  # noqa: F811
    pve1_transport.run(["true"])  # connected
    before = pve1.sshd.log.count("Accepted publickey")
    argv = ["sh", "-c", "date +%s.%N; sleep 0.4; date +%s.%N"]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda _: pve1_transport.run(argv), range(12)))
    assert pve1.sshd.log.count("Accepted publickey") == before
    spans = [tuple(map(float, r.text.split())) for r in results]
    peak = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert 2 <= peak <= 8


def test_accept_new_appends_unknown_key(pve1, tmp_path):  # noqa: F811
    known = tmp_path / "known_hosts"
    with _closing(pve1.transport(known_hosts=known, host_key_policy="accept-new")) as t:
        assert t.run(["true"]).ok
    assert known.read_text() == pve1.sshd.known_hosts_line + "\n"
    with _closing(pve1.transport(known_hosts=known, host_key_policy="accept-new")) as t:  # known now
        assert t.run(["true"]).ok
    assert known.read_text().count("\n") == 1


def test_changed_host_key_is_refused_with_hint(pve1, tmp_path):  # noqa: F811
    other = keygen(tmp_path / "other")
    stale = " ".join(Path(f"{other}.pub").read_text().split()[:2])
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{pve1.sshd.port} {stale}\n")
    with pytest.raises(HostKeyError) as info:
        pve1.transport(known_hosts=known, attempts=1).run(["true"])
    msg = str(info.value)
    assert "HOST KEY CHANGED" in msg and f"ssh-keygen -f {known} -R '[127.0.0.1]:" in msg
    assert info.value.exit_code == 3
    assert known.read_text().count("\n") == 1  # nothing appended


def test_strict_refuses_unknown_and_accepts_known(pve1, tmp_path):  # noqa: F811
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(HostKeyError, match="StrictHostKeyChecking is yes"):
        pve1.transport(known_hosts=empty, host_key_policy="strict", attempts=1).run(["true"])
    assert empty.read_text() == ""
    with _closing(pve1.transport(host_key_policy="strict")) as t:
        assert t.run(["true"]).ok


def test_home_ssh_config_is_honoured(pve1, fleet_client_key, tmp_path):  # noqa: F811
    """~/.ssh/config of the user's home as OpenSSH finds it (the password database, not $HOME):
    a private mount namespace puts a test .ssh directory over it, for ssh and ddtctl alike."""
    ssh_dir = tmp_path / "dotssh"
    write_client_files(ssh_dir, [pve1.sshd], fleet_client_key,
                       extra={"pve1": {"StrictHostKeyChecking": "accept-new"}}, known=False)
    (ssh_dir / "known_hosts").unlink()
    code = ("from ddtctl.remote.ssh import SshTransport; t = SshTransport('pve1', attempts=1); "
            "print(t.run(['id', '-un']).text.strip()); t.close()")
    res = with_home_ssh(ssh_dir, [sys.executable, "-c", code])
    assert res.returncode == 0 and res.stdout.strip() == "root", res.stderr
    # written to ~/.ssh/known_hosts; hashed when the system ssh_config says HashKnownHosts yes
    hashed = "hashknownhosts yes" in subprocess.run(["ssh", "-G", "x"], capture_output=True,
                                                    text=True, stdin=subprocess.DEVNULL).stdout
    (line,) = (ssh_dir / "known_hosts").read_text().splitlines()
    name, key = line.split(" ", 1)
    assert key == pve1.sshd.host_key_line
    assert name.startswith("|1|") if hashed else name == f"[127.0.0.1]:{pve1.sshd.port}"
    assert host_matches(f"[127.0.0.1]:{pve1.sshd.port}", name)


def test_proxyjump_through_second_sshd(pve1, jump, fleet_client_key, tmp_path):  # noqa: F811
    known = tmp_path / "known_hosts"
    both = {"StrictHostKeyChecking": "accept-new", "UserKnownHostsFile": str(known)}
    config, known = write_client_files(tmp_path, [pve1.sshd, jump], fleet_client_key,
                                       extra={"pve1": {"ProxyJump": "jump", **both}, "jump": both},
                                       known=False)
    before = jump.log.count("Accepted publickey")
    with _closing(SshTransport("pve1", ssh_config=config, known_hosts=known)) as t:
        assert t.run(["sh", "-c", "echo $DDT_FAKE_PVE"]).text.strip() == str(pve1.state)
        assert isinstance(t.transport().sock, paramiko.Channel)  # tunnelled, not a TCP socket
    assert jump.log.count("Accepted publickey") == before + 1
    assert set(known.read_text().splitlines()) == {pve1.sshd.known_hosts_line, jump.known_hosts_line}


def test_unreachable_and_auth_failure(pve1, tmp_path):  # noqa: F811
    started = time.monotonic()
    with pytest.raises(UnreachableError) as info:
        SshTransport("127.0.0.1", port=free_port(), attempts=2, known_hosts=tmp_path / "kh").run(["true"])
    assert info.value.exit_code == 3 and time.monotonic() - started < 10
    stranger = keygen(tmp_path / "stranger")
    t = SshTransport("127.0.0.1", port=pve1.sshd.port, user="root", identity_file=stranger,
                     known_hosts=pve1.known_hosts, attempts=1)
    with pytest.raises(UnreachableError, match="authentication failed"):
        t.run(["true"])


def test_put_resumes_after_interruption_and_verifies(pve1_transport, tmp_path):
    data = os.urandom(5 * 1024 * 1024 + 123)
    src = tmp_path / "weights.bin"
    src.write_bytes(data)
    dest = f"/tmp/ddt-put-{os.getpid()}/w.bin"

    def boom(done, total):
        if done >= 2 * 1024 * 1024:
            raise KeyboardInterrupt("simulated interruption")

    with pytest.raises(KeyboardInterrupt):
        pve1_transport.put(src, dest, progress=boom)
    partial = os.path.getsize(dest + ".part")  # the node is this machine
    assert 2 * 1024 * 1024 <= partial < len(data)
    seen = []
    res = pve1_transport.put(src, dest, mode=0o600, progress=lambda d, t: seen.append((d, t)))
    assert res.bytes_sent == len(data) - partial and not res.skipped
    remote_sum = pve1_transport.run(["sha256sum", dest]).text[:64]
    assert res.sha256 == hashlib.sha256(data).hexdigest() == remote_sum
    assert seen[-1] == (len(data), len(data)) and seen[0][0] > partial
    assert not os.path.exists(dest + ".part") and os.stat(dest).st_mode & 0o777 == 0o600
    assert pve1_transport.put(src, dest, mode=0o600).skipped
    # a partial file whose prefix does not match is discarded: everything is sent again
    Path(dest + ".part").write_bytes(b"x" * 1000)
    Path(dest).unlink()
    assert pve1_transport.put(src, dest).bytes_sent == len(data)
    assert Path(dest).read_bytes() == data


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = f"hello {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_forward_reaches_a_port_as_seen_from_the_node(pve1_transport):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pve1_transport.forward("127.0.0.1", server.server_address[1]) as (host, port):
            assert port != server.server_address[1]
            for i in range(3):
                assert httpx.get(f"http://{host}:{port}/r{i}", timeout=5).text == f"hello /r{i}"
    finally:
        server.shutdown()


def test_dropped_connection_retried_only_for_idempotent_commands(pve1, tmp_path):  # noqa: F811
    # the first run kills the sshd process serving this connection (the shell's parent)
    marker = tmp_path / "ran-once"
    script = f'if [ ! -e {marker} ]; then touch {marker}; kill -9 $PPID; sleep 5; fi; echo done'
    with _closing(pve1.transport()) as t:
        t.run(["true"])
        with pytest.raises(UnreachableError, match="connection"):
            t.run(["sh", "-c", script])  # it may have had effects: never re-run blindly
        assert marker.exists()
        marker.unlink()
        before = pve1.sshd.log.count("Accepted publickey")
        assert t.run(["sh", "-c", script], idempotent=True).text == "done\n"
        # killed again on a fresh connection, then retried on another one
        assert pve1.sshd.log.count("Accepted publickey") == before + 2


def test_background_child_holding_stdout_does_not_hang(pve1_transport):
    started = time.monotonic()
    res = pve1_transport.run(["sh", "-c", "sleep 4 & echo started"], timeout=20)
    assert res.ok and res.stdout == b"started\n"
    assert time.monotonic() - started < 3.9  # returned after the grace period, not at EOF


def test_unit_state_reads_survive_one_dropped_connection(pve1, tmp_path):  # noqa: F811
    """SystemdManager's reads (``systemctl show``, the journal) are idempotent: the connection the
    first read runs on dies under it (its sshd is killed), the transport reconnects once and the read
    runs again, so a readiness poll does not fail on one dropped connection; a start is not re-run."""
    from ddtctl.ops.supervisor import SystemdManager

    marker = tmp_path / "dropped"

    class DropFirst:   # the real transport; a command run while the marker is absent kills its connection
        def __init__(self, t):
            self.t, self.name = t, t.name

        def run(self, argv, **kw):
            script = f'if [ ! -e {marker} ]; then touch {marker}; kill -9 $PPID; sleep 5; fi; exec "$@"'
            return self.t.run(["sh", "-c", script, "sh", *argv], **kw)

    with _closing(pve1.transport()) as t:
        t.run(["true"])
        before = pve1.sshd.log.count("Accepted publickey")
        state = SystemdManager(DropFirst(t), "ddtree-x.service").state()   # no UnreachableError
        assert marker.exists() and state.active   # whatever systemctl says here, the read came back
        assert pve1.sshd.log.count("Accepted publickey") == before + 1      # reconnected once
        marker.unlink()
        with pytest.raises(UnreachableError, match="connection"):
            SystemdManager(DropFirst(t), "ddtree-x.service").stop()       # a change: never re-run blindly
