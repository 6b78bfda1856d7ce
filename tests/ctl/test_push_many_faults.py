"""Faults of the batched sync (remote/push_many.py) by class, on real components (tests/fleet).

The peer killed or frozen mid-stream (its own node: a real sshd SIGKILLed or SIGSTOPped), the
remote tar killed (a closed pipe) or stuck past the stream's deadline, a full disk (a 1 MiB tmpfs
bound into the container) and a staged file corrupted before verification: each is a clear error
of push_file's classes (UnreachableError, TransferError, CommandTimeout), no final name changes,
and the staging folder is removed (or, when the peer is gone, ignored by the next sync).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ddtctl.errors import CommandTimeout, TransferError, UnreachableError
from ddtctl.ops.weights import MANIFEST, local_manifest, sync_model
from ddtctl.remote import push_many
from ddtctl.remote.pct import ContainerTransport
from ddtctl.remote.ssh import SshTransport
from tests.ctl.test_push_many import CT, _local_tree, _manifest, _model, _tree, node, ssh  # noqa: F401
from tests.fleet.conftest import fleet_client_key, make_node  # noqa: F401
from tests.fleet.node import FakeNode
from tests.fleet.sshd import freeze, kill_sshd, thaw, write_client_files

pytestmark = pytest.mark.fleet
FULL = 741
FAST = {"StrictHostKeyChecking": "yes", "ConnectTimeout": "2", "ServerAliveInterval": "1",
        "ServerAliveCountMax": "2"}


def _v1_then_v2(tmp_path: Path, n2: int = 6, size2: int = 3000) -> tuple[Path, Path]:
    return _model(tmp_path / "v1", 6, "1"), _model(tmp_path / "v2", n2, "2", size2)


def _unchanged(t, folder: str, v1: Path) -> None:
    """Every final name still holds v1, and the manifest is v1's."""
    assert _tree(t, folder) == _local_tree(v1)
    assert _manifest(t, folder)["files"] == local_manifest(v1)


def test_a_staged_file_corrupted_before_verification_places_nothing(node, ssh, tmp_path, monkeypatch):
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    v1, v2 = _v1_then_v2(tmp_path)
    folder = f"/srv/pm/corrupt-{os.getpid()}"
    ct = ContainerTransport(ssh, CT)
    sync_model(ct, "m", v1, folder)

    class Corrupting(ContainerTransport):
        def stream(self, argv, **kw):
            code = super().stream(argv, **kw)
            staging = argv[argv.index("-C") + 1]
            self.run(["sh", "-c", 'f=$(find "$1" -type f | sort | head -n 1); printf x >> "$f"', "sh", staging]).check()
            return code

    with pytest.raises(TransferError, match=r"sha256 mismatch after sending 1 of \d+ files \(nothing was placed\)"):
        sync_model(Corrupting(ssh, CT), "m", v2, folder)
    _unchanged(ct, folder, v1)


@pytest.fixture(scope="module")
def full_disk(node, tmp_path_factory):
    """ct741 with a 1 MiB tmpfs of this machine bound at /srv/full (mp0)."""
    disk = tmp_path_factory.mktemp("full") / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "ddt-full", str(disk)], check=True)
    conf = node.state / "lxc" / f"{FULL}.conf"
    if conf.exists():
        node.pct("stop", str(FULL), check=False)
        conf.unlink()
    node.create_container(FULL, "ct741", config={"mp0": f"{disk},mp=/srv/full"})
    yield disk
    node.pct("stop", str(FULL), check=False)
    conf.unlink()
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_fails_clearly_and_changes_no_final_name(node, ssh, full_disk, tmp_path, monkeypatch):
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    v1, v2 = _v1_then_v2(tmp_path, n2=40, size2=40_000)               # v2: 1.6 MB > the 1 MiB disk
    ct = ContainerTransport(ssh, FULL)
    sync_model(ct, "m", v1, "/srv/full/m")
    with pytest.raises(TransferError, match="No space left on device") as info:
        sync_model(ct, "m", v2, "/srv/full/m")
    assert info.value.exit_code == 1 and "tar into /srv/full/m/.incoming-" in str(info.value)
    _unchanged(ct, "/srv/full/m", v1)
    assert sorted(p.name for p in (full_disk / "m").iterdir()) == sorted([*os.listdir(v1), MANIFEST])


def _pids(needle: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(pid))
            except OSError:
                continue
    return pids


def test_the_remote_tar_killed_mid_stream(node, ssh, tmp_path, monkeypatch):
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    v1, v2 = _v1_then_v2(tmp_path, n2=48, size2=200_000)
    folder = f"/srv/pm/killed-tar-{os.getpid()}"
    ct = ContainerTransport(ssh, CT)
    sync_model(ct, "m", v1, folder)
    killed = []

    def factory(label, total):
        def progress(done, _total):
            if done > 2_000_000 and not killed:
                for pid in _pids(f"tar -x -f - -C {folder}/.incoming-"):
                    try:
                        if Path(f"/proc/{pid}/comm").read_text().strip() == "tar":
                            os.kill(pid, signal.SIGKILL)
                            killed.append(pid)
                    except OSError:
                        pass
        return progress

    with pytest.raises(TransferError, match=r"tar into .* failed \(exit 137\): killed by signal 9"):
        sync_model(ct, "m", v2, folder, progress_factory=factory)
    assert killed
    _unchanged(ct, folder, v1)
    assert ".incoming" not in ct.run(["ls", "-a", folder]).text


def test_a_stuck_remote_tar_ends_at_the_deadline(node, tmp_path, monkeypatch):
    """A live connection whose tar never finishes (a hung disk): timeout(1) inside the container
    stops it at the stream's deadline (CHUNK_TIMEOUT cut to 2 s here): CommandTimeout, nothing placed."""
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    slow = tmp_path / "slow_tar"
    slow.write_text('#!/bin/sh\n[ -e /srv/slow-tar ] && sleep 30\nexec /usr/bin/tar "$@"\n')
    slow.chmod(0o755)
    conf = node.state / "lxc" / "743.conf"
    if conf.exists():
        node.pct("stop", "743", check=False)
        conf.unlink()
    node.create_container(743, "ct743", binds={"/usr/local/bin/tar": slow})
    transport = node.transport()
    try:
        ct = ContainerTransport(transport, 743)
        v1, v2 = _v1_then_v2(tmp_path)
        sync_model(ct, "m", v1, "/srv/m")
        ct.run(["touch", "/srv/slow-tar"]).check()
        monkeypatch.setattr(push_many, "CHUNK_TIMEOUT", 2.0)
        t0 = time.monotonic()
        with pytest.raises(CommandTimeout, match=r"sending \d+ files into /srv/m/.incoming-\w+ timed out after 2 s"):
            sync_model(ct, "m", v2, "/srv/m")
        assert time.monotonic() - t0 < 15
        _unchanged(ct, "/srv/m", v1)
        assert ".incoming" not in ct.run(["ls", "-a", "/srv/m"]).text
    finally:
        transport.close()
        node.pct("stop", "743", check=False)
        conf.unlink()


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_the_peer_killed_or_frozen_mid_stream(fault, fleet_client_key, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    v1, v2 = _v1_then_v2(tmp_path, n2=48, size2=200_000)
    node = FakeNode(f"pm-{fault}", tmp_path / "node", fleet_client_key).start()
    stopped: list[int] = []
    try:
        node.create_container(742, "ct742")
        config, known = write_client_files(tmp_path / "client", [node.sshd], fleet_client_key,
                                           extra={node.name: FAST})
        t = ContainerTransport(SshTransport(node.name, ssh_config=config, known_hosts=known), 742)
        sync_model(t, "m", v1, "/srv/m")
        hit = []

        def factory(label, total):
            def progress(done, _total):
                if done > 2_000_000 and not hit:
                    hit.append(time.monotonic())
                    stopped.extend(freeze(node.sshd)) if fault == "frozen" else kill_sshd(node.sshd)
            return progress

        with pytest.raises(UnreachableError) as info:
            sync_model(t, "m", v2, "/srv/m", progress_factory=factory)
        assert hit and time.monotonic() - hit[0] < 12 and info.value.exit_code == 3
        t.node.close()
        final = node.private_path(742, "/srv/m")                     # read on this machine: the peer is gone
        assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in final.iterdir() if p.is_file()
                and p.name != MANIFEST} == {r: e["sha256"] for r, e in local_manifest(v1).items() if "/" not in r}
        thaw(stopped)
        if fault == "killed":
            node.sshd.stop()
            node.start()
        t2 = ContainerTransport(node.transport(options=FAST), 742)  # the next run: leftovers ignored
        res = sync_model(t2, "m", v2, "/srv/m")
        assert res.files_sent == len(local_manifest(v2)) - 1                 # empty.txt was there
        assert {k: v for k, v in _tree(t2, "/srv/m").items() if not k.startswith(".")} == _local_tree(v2)
        t2.node.close()
    finally:
        thaw(stopped)
        node.close()
