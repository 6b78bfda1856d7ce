"""A silent node, at the transport: a peer that stops answering (SIGSTOP on a REAL sshd, so the
TCP connection stays open and nothing answers) or dies (SIGKILL) never hangs SshTransport or
ContainerTransport: connect, a running command, an idle connection, an SFTP push, a streamed `dd`
push and an HTTP request through a forwarded port all end within the deadlines of the ssh config
(ConnectTimeout 2 s, ServerAliveInterval 1 s x ServerAliveCountMax 2) with UnreachableError
(exit 3). Each test has its own sshd (tests/fleet/sshd.py), so freezing and killing stay local.
"""

from __future__ import annotations

import http.server
import os
import threading
import time
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from ddtctl.errors import UnreachableError
from ddtctl.remote.pct import ContainerTransport
from ddtctl.remote.ssh import SshTransport
from tests.fleet.conftest import fleet_client_key, make_node  # noqa: F401 - fixtures
from tests.fleet.node import FakeNode
from tests.fleet.sshd import SshServer, freeze, kill_sshd, thaw, write_client_files

pytestmark = pytest.mark.fleet
FAST = {"StrictHostKeyChecking": "yes", "ConnectTimeout": "2", "ServerAliveInterval": "1",
        "ServerAliveCountMax": "2"}


@pytest.fixture()
def server(tmp_path, fleet_client_key):  # noqa: F811
    pub = Path(f"{fleet_client_key}.pub").read_text()
    srv = SshServer(tmp_path / "sshd", alias="quiet", client_pubkeys=[pub]).start()
    frozen: list[int] = []
    srv.frozen = frozen
    yield srv
    thaw(frozen)
    srv.stop()


def _transport(srv: SshServer, key: Path, tmp_path: Path) -> SshTransport:
    config, known = write_client_files(tmp_path / "client", [srv], key, extra={"quiet": FAST})
    return SshTransport("quiet", ssh_config=config, known_hosts=known)


def _freeze(srv, **kw) -> None:
    srv.frozen += freeze(srv, **kw)


def test_frozen_at_connect_fails_within_connect_timeout_then_fast(server, fleet_client_key, tmp_path):  # noqa: F811
    _freeze(server)
    t = _transport(server, fleet_client_key, tmp_path)
    t0 = time.monotonic()
    with pytest.raises(UnreachableError, match=r"unreachable \(no answer in 2 s\)") as info:
        t.run(["true"])
    assert time.monotonic() - t0 < 5 and info.value.exit_code == 3
    t0 = time.monotonic()
    with pytest.raises(UnreachableError, match=r"no answer in 2 s"):
        t.run(["true"])                                 # known unreachable: no second wait
    assert time.monotonic() - t0 < 0.5


def test_frozen_session_mid_command_ends_it_and_a_new_connection_works(server, fleet_client_key,  # noqa: F811
                                                                       tmp_path):
    with closing(_transport(server, fleet_client_key, tmp_path)) as t:
        assert t.run(["true"]).ok
        threading.Timer(0.7, lambda: _freeze(server, sessions_only=True)).start()
        t0 = time.monotonic()
        with pytest.raises(UnreachableError, match=r"unreachable \(no answer in 2 s\) while running sh"):
            t.run(["sh", "-c", "sleep 30"])             # not idempotent: never re-run blindly
        assert time.monotonic() - t0 < 6
        assert t.run(["echo", "again"]).text == "again\n"   # the listener answers: reconnected


def test_keepalive_notices_an_idle_frozen_connection(server, fleet_client_key, tmp_path):  # noqa: F811
    with closing(_transport(server, fleet_client_key, tmp_path)) as t:
        paramiko_transport = t.transport()
        _freeze(server, sessions_only=True)
        t0 = time.monotonic()
        while paramiko_transport.is_active() and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert not paramiko_transport.is_active() and time.monotonic() - t0 < 4


@pytest.mark.parametrize("fault", ["frozen", "killed"])
def test_sftp_push_to_a_node_that_goes_away(server, fleet_client_key, tmp_path, fault):  # noqa: F811
    src = tmp_path / "w.bin"
    src.write_bytes(os.urandom(24 * 1024 * 1024))
    hit = []

    def progress(done: int, total: int) -> None:
        if done >= 2 * 1024 * 1024 and not hit:
            hit.append(time.monotonic())
            _freeze(server) if fault == "frozen" else kill_sshd(server)

    with closing(_transport(server, fleet_client_key, tmp_path)) as t:
        with pytest.raises(UnreachableError) as info:
            t.put(src, str(tmp_path / "dest" / "w.bin"), progress=progress)
    assert hit and time.monotonic() - hit[0] < 8
    assert info.value.exit_code == 3
    if fault == "frozen":
        assert "no answer in 2 s" in str(info.value)


def test_dd_push_into_a_container_when_sshd_is_killed(fleet_client_key, tmp_path):  # noqa: F811
    node = FakeNode("fz-kill", tmp_path / "node", fleet_client_key).start()
    try:
        node.create_container(320, "ct320")
        src = tmp_path / "w.bin"
        src.write_bytes(os.urandom(24 * 1024 * 1024))          # >= 8 MiB: streamed `dd` chunks
        config, known = write_client_files(tmp_path / "client", [node.sshd], fleet_client_key,
                                           extra={"fz-kill": FAST})
        t = ContainerTransport(SshTransport("fz-kill", ssh_config=config, known_hosts=known), 320)
        hit = []

        def progress(done: int, total: int) -> None:
            if not hit:
                hit.append(time.monotonic())
                kill_sshd(node.sshd)

        with pytest.raises(UnreachableError) as info:
            t.put(src, "/srv/w.bin", progress=progress)
        assert time.monotonic() - hit[0] < 8 and info.value.exit_code == 3
        t.node.close()
    finally:
        node.close()


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"hi")

    def log_message(self, *args):
        pass


def test_http_through_a_forward_of_a_frozen_node_fails_fast(server, fleet_client_key, tmp_path):  # noqa: F811
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        with closing(_transport(server, fleet_client_key, tmp_path)) as t:
            with t.forward("127.0.0.1", web.server_address[1]) as (host, port):
                assert httpx.get(f"http://{host}:{port}/", timeout=5).text == "hi"
                _freeze(server)
                t0 = time.monotonic()
                with pytest.raises(httpx.HTTPError):
                    httpx.get(f"http://{host}:{port}/", timeout=30)
                assert time.monotonic() - t0 < 8
    finally:
        web.shutdown()
