"""A streamed push into a container survives a connection that dies in the middle of a chunk.

The chunk commands (`dd of=<part> seek=<offset> conv=notrunc`) write the same bytes at the same
offset when repeated, so they are marked idempotent: after the node's connection is lost while one
runs, the transport reconnects and sends that chunk again, and the final sha256 check covers the
whole file. Here the real sshd's session process is SIGKILLed while the second chunk is in flight
(the container's `dd` is tests/fleet/slow_dd, which waits 1 s first, so the moment is certain);
before, such a deploy failed with "connection lost while running pct: connection lost".
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path

from ddtctl.remote.pct import STREAM_CHUNK, ContainerTransport
from tests.fleet.conftest import make_node  # noqa: F401
from tests.fleet.sshd import sshd_pids

FLEET_DIR = Path(__file__).resolve().parent
DEST = "/srv/push-recovery/blob.bin"


def _running(needle: str) -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    return True
            except OSError:
                continue
    return False


def test_a_push_survives_a_connection_killed_mid_chunk(make_node, tmp_path):  # noqa: F811
    node = make_node("pr-a")
    if 730 not in node.running():
        node.create_container(730, "ct730", binds={"/usr/local/bin/dd": FLEET_DIR / "slow_dd"})
    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(3 * STREAM_CHUNK))
    killed: list[int] = []

    def killer() -> None:
        needle = f"of={DEST}.part bs=1M seek={STREAM_CHUNK} "
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _running(needle):
            time.sleep(0.05)
        for pid in sshd_pids(node.sshd, sessions_only=True):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    transport = node.transport()
    try:
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        res = ContainerTransport(transport, 730).put(blob, DEST)
        thread.join(5)
        assert killed, "the connection was not cut during the push"
        assert res.bytes_sent >= blob.stat().st_size and not res.skipped
        got = ContainerTransport(transport, 730).run(["sha256sum", "--", DEST], timeout=60)
        assert got.text.split()[0] == hashlib.sha256(blob.read_bytes()).hexdigest()
    finally:
        transport.close()
