"""ContainerTransport and the pct emulation's semantics over a real sshd.

The pct semantics emulated and checked: docs/operations.md §13.2-§13.4 (pct(1), pve-container's
pct.pm).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import pytest

from ddtctl.errors import RemoteError, TransferError
from ddtctl.remote import pct as pct_mod
from ddtctl.remote.command import LXC_DEFAULT_PATH, pct_push
from ddtctl.remote.pct import ContainerTransport
from tests.fleet.conftest import make_node, pve1, pve1_transport  # noqa: F401 - fixtures

pytestmark = pytest.mark.fleet
A, B, STOPPED = 220, 221, 222


@pytest.fixture(scope="module")
def node(pve1, pve1_transport):  # noqa: F811
    for vmid, name in ((A, "ct-a"), (B, "ct-b"), (STOPPED, "ct-off")):
        if not (pve1.state / "lxc" / f"{vmid}.conf").exists():
            pve1.create_container(vmid, name, start=vmid != STOPPED)
    return pve1_transport


@pytest.fixture
def ct(node):
    return ContainerTransport(node, A)


def test_exit_status_signal_and_not_found(ct):
    assert ct.run(["sh", "-c", "exit 42"]).exit_code == 42
    assert ct.run(["sh", "-c", "kill -9 $$"]).exit_code == 137
    assert ct.run(["no-such-program"]).exit_code == 127
    res = ct.run(["sh", "-c", "echo o; echo e >&2"])
    assert (res.stdout, res.stderr, res.transport) == (b"o\n", b"e\n", f"ct{A}@pve1")


def test_environment_is_exactly_the_clean_one(ct):
    env = dict(line.split("=", 1) for line in ct.run(["env"]).text.splitlines())
    assert env == {"HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                   "PATH": LXC_DEFAULT_PATH}
    assert ct.run(["sh", "-c", 'echo "$A"'], env={"A": "x y"}).text == "x y\n"


def test_raw_pct_exec_semantics(node):
    bad = node.run(["pct", "exec", str(A), "ls", "-la"])  # no `--`: Getopt eats -la
    assert bad.exit_code == 255 and b"Unknown option: la" in bad.stderr
    missing = node.run(["pct", "exec", str(A)])
    assert missing.exit_code == 255 and b"missing command" in missing.stderr
    keep = node.run(["pct", "exec", str(A), "--", "sh", "-c", 'echo "$PATH $container"'])
    assert keep.text == "/sbin:/bin:/usr/sbin:/usr/bin lxc\n"  # keep-env 1 is still the default
    late = node.run(["pct", "exec", str(A), "sh", "--keep-env", "0", "--", "-c", "echo $HOME"])
    assert late.text == "\n"  # permute: the option after a positional is still pct's


def test_not_running_and_not_on_this_node(node):
    res = ContainerTransport(node, STOPPED).run(["true"])
    assert res.exit_code == 255 and b"not running" in res.stderr
    with pytest.raises(RemoteError, match=f"ct{STOPPED}@pve1"):
        res.check()
    res = ContainerTransport(node, 999).run(["true"])
    assert res.exit_code != 0 and b"nodes/pve1/lxc/999.conf' does not exist" in res.stderr


def test_status_list_and_containers_are_isolated(node, ct, pve1):  # noqa: F811
    assert node.run(["pct", "status", str(STOPPED)]).text == "status: stopped\n"
    lines = node.run(["pct", "list"]).text.splitlines()
    assert lines[0] == "%-10s %-10s %-12s %-20s" % ("VMID", "Status", "Lock", "Name")
    assert "%-10s %-10s %-12s %-20s" % (A, "running", "", "ct-a") in lines
    ct.run(["sh", "-c", "echo mine > /opt/only-in-a"]).check()
    assert not Path("/opt/only-in-a").exists()
    assert pve1.private_path(A, "/opt/only-in-a").read_text() == "mine\n"
    assert ContainerTransport(node, B).run(["cat", "/opt/only-in-a"]).exit_code == 1
    assert ct.run(["touch", "/usr/ddt-ro-check"]).exit_code != 0  # the rest is read-only


def test_raw_pct_push_exits_0_after_task_error(node, tmp_path):
    src = f"/tmp/ddt-raw-push-{os.getpid()}"
    node.run(["sh", "-c", f"echo payload > {src}"]).check()
    res = node.run(pct_push(A, src, "/opt/missing-parent/file"))
    assert res.exit_code == 0 and res.stderr.startswith(b"TASK ERROR: ")
    assert b"No such file or directory" in res.stderr
    res = node.run(pct_push(STOPPED, src, "/opt/file"))
    assert res.exit_code == 255 and b"can only push files to a running CT" in res.stderr
    node.run(["rm", "-f", src])


def test_small_put_creates_parent_verifies_and_skips(ct, node, tmp_path):
    src = tmp_path / f"unit-{uuid.uuid4().hex}.env"       # its staging copies carry this unique name
    src.write_bytes(b"A='1 2'\nB=$x\n")
    dest = "/etc/ddtree/deep/dir/unit.env"
    res = ct.put(src, dest, mode=0o640)
    assert res.bytes_sent == src.stat().st_size and not res.skipped
    assert ct.run(["stat", "-c", "%a %s", dest]).text == f"640 {src.stat().st_size}\n"
    assert ct.run(["cat", dest]).stdout == src.read_bytes()
    assert ct.put(src, dest, mode=0o640).skipped
    # the staging copies on the node (ddtctl-<uuid>-<name> in the staging dir) are removed; only this
    # test's own name is counted (other processes may stage files in the shared /tmp meanwhile)
    leftovers = node.run(["sh", "-c", 'ls "$1" | grep -c -F -e "-$2" || true', "sh", ct.staging_dir, src.name])
    assert leftovers.text.strip() == "0"


def test_small_put_detects_pct_push_exit_0_failure(ct, tmp_path):
    src = tmp_path / "cfg.json"
    src.write_text("{}")
    dest = "/opt/trap/cfg.json"
    ct.run(["mkdir", "-p", dest + ".part"]).check()  # pct push will fail: "Is a directory"
    with pytest.raises(TransferError, match="Is a directory"):
        ct.put(src, dest)
    assert ct.run(["test", "-e", dest]).exit_code == 1


def test_large_put_streams_and_resumes(ct, tmp_path, pve1, monkeypatch):  # noqa: F811
    monkeypatch.setattr(pct_mod, "SMALL_FILE", 1024 * 1024)
    monkeypatch.setattr(pct_mod, "STREAM_CHUNK", 1024 * 1024)
    data = os.urandom(3 * 1024 * 1024 + 7)
    src = tmp_path / "model.safetensors"
    src.write_bytes(data)
    dest = "/srv/models/m/model.safetensors"

    def boom(done, total):
        if done >= 2 * 1024 * 1024:
            raise KeyboardInterrupt("simulated interruption")

    with pytest.raises(KeyboardInterrupt):
        ct.put(src, dest, progress=boom)
    part = pve1.private_path(A, dest + ".part")
    assert part.stat().st_size == 2 * 1024 * 1024
    res = ct.put(src, dest)
    assert res.bytes_sent == len(data) - 2 * 1024 * 1024
    assert res.sha256 == hashlib.sha256(data).hexdigest()
    assert pve1.private_path(A, dest).read_bytes() == data and not part.exists()
    part.write_bytes(b"\0" * 1024)  # a partial file with a wrong prefix is discarded
    pve1.private_path(A, dest).unlink()
    assert ct.put(src, dest).bytes_sent == len(data)


def test_set_mount_point_and_bind_hook_apply_at_next_start(node, pve1, tmp_path):  # noqa: F811
    models = tmp_path / "models"
    models.mkdir()
    (models / "w.txt").write_text("weights\n")
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H200, 143771 MiB'\n")
    fake.chmod(0o755)
    ct = ContainerTransport(node, B)
    node.run(["pct", "set", str(B), "-mp0", f"{models},mp=/srv/models-ro,ro=1"]).check()
    pve1.add_bind(B, "/usr/bin/nvidia-smi", fake)  # missing in the CT view: created by overlay
    pve1.add_bind(B, "/usr/bin/systemctl", fake)  # existing path: bound over
    assert ct.run(["cat", "/srv/models-ro/w.txt"]).exit_code == 1  # not before a restart
    assert b"mp0: " in node.run(["pct", "config", str(B)]).stdout
    node.run(["pct", "stop", str(B)]).check()
    node.run(["pct", "start", str(B)]).check()
    assert ct.run(["cat", "/srv/models-ro/w.txt"]).text == "weights\n"
    assert ct.run(["touch", "/srv/models-ro/new"]).exit_code != 0  # ro=1
    assert ct.run(["nvidia-smi"]).text == "NVIDIA H200, 143771 MiB\n"
    assert ct.run(["systemctl"]).text == "NVIDIA H200, 143771 MiB\n"
    assert not Path("/usr/bin/nvidia-smi").exists()  # the host tree is untouched
    assert ct.run(["test", "-x", "/usr/bin/ls"]).ok  # the rest of /usr/bin is still there
