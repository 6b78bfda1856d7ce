"""Many small files in one go (remote/push_many.py, ops/weights_send.py) on real components.

Containers of the pct emulation over a real sshd (tests/fleet/node.py), a node over plain SSH and
this machine: the batched manifest sync (one tar stream, one sha256sum, one mv per folder) leaves
the same tree and manifest as the per-file push, a re-run sends nothing, a 50-file sync costs the
same small number of remote commands as a 5-file one, and a dead run's staging folder is ignored,
then removed once stale. Faults by class: tests/ctl/test_push_many_faults.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from ddtctl.ops import weights_send
from ddtctl.ops.weights import MANIFEST, local_manifest, sync_model
from ddtctl.remote.pct import ContainerTransport
from ddtctl.remote.transport import LocalTransport
from tests.fleet.conftest import make_node, pve1, pve1_transport  # noqa: F401

pytestmark = pytest.mark.fleet
CT = 740


class Counting:
    """A node transport that records the commands sent through it (run, stream, put)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.name = inner.name

    def run(self, argv, **kw):
        self.calls.append(("run", list(argv)))
        return self.inner.run(argv, **kw)

    def stream(self, argv, **kw):
        self.calls.append(("stream", list(argv)))
        return self.inner.stream(argv, **kw)

    def put(self, *args, **kw):
        self.calls.append(("put", args))
        return self.inner.put(*args, **kw)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


@pytest.fixture(scope="module")
def node(make_node):  # noqa: F811
    pm = make_node("pm-a")
    if CT not in pm.running():
        pm.create_container(CT, "ct740")
    return pm


@pytest.fixture(scope="module")
def ssh(node):
    transport = node.transport()
    yield transport
    transport.close()


def _model(root: Path, n: int, seed: str = "a", size: int = 3000) -> Path:
    """n small files of different sizes, one nested, one empty, one with an awkward name."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"pkg{i:02d}-1.0-py3-none-any.whl").write_bytes(hashlib.sha256(f"{seed}{i}".encode()).digest()
                                                                * ((size + i * 37) // 32))
    (root / "sub" / "deeper").mkdir(parents=True, exist_ok=True)
    (root / "sub" / "deeper" / "config.json").write_text(json.dumps({"seed": seed}))
    (root / "empty.txt").write_bytes(b"")
    (root / "name with 'quotes' and ü.txt").write_text(seed * 10)
    return root


def _tree(t, folder: str) -> dict[str, tuple]:
    """{relative path: (size, mode, sha256)} of the files under `folder` on the target, the
    manifest left out."""
    listing = t.run(["find", folder, "-type", "f", "-printf", "%P\\t%s\\t%m\\n"], timeout=60).check().text
    out = {}
    for line in listing.splitlines():
        rel, size, mode = line.split("\t")
        if rel != MANIFEST:
            digest = t.run(["sha256sum", "--", f"{folder}/{rel}"], timeout=60).check().text.split()[0]
            out[rel] = (int(size), mode, digest.lstrip("\\"))
    return out


def _cmd(argv: list[str]) -> str:
    """The program of a `pct exec VMID --keep-env 0 -- /usr/bin/env -i K=V x4 PROGRAM ...` argv."""
    return argv[argv.index("--") + 7]


def _local_tree(root: Path) -> dict[str, tuple]:
    return {rel: (e["size"], "644", e["sha256"]) for rel, e in local_manifest(root).items()}


def _manifest(t, folder: str) -> dict:
    return json.loads(t.run(["cat", f"{folder}/{MANIFEST}"], timeout=60).check().text)


def test_fifty_small_files_cost_the_commands_of_five(node, ssh, tmp_path, monkeypatch):
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    counts = {}
    for n in (5, 50):
        src = _model(tmp_path / f"m{n}", n)
        counting = Counting(ssh)
        ct = ContainerTransport(counting, CT)
        folder = f"/srv/pm/count-{n}-{os.getpid()}"
        res = sync_model(ct, "wheelhouse", src, folder)
        assert (res.files_sent, res.bytes_sent) == (n + 3, sum(e["size"] for e in local_manifest(src).values()))
        counts[n] = [(kind, _cmd(argv)) for kind, argv in counting.calls]
        assert _tree(ct, folder) == _local_tree(src)
        counting.calls.clear()
        again = sync_model(ct, "wheelhouse", src, folder)
        assert (again.files_sent, again.bytes_sent, again.changed) == (0, 0, False)
        assert [_cmd(argv) for _, argv in counting.calls] == ["cat", "find"]
    assert counts[5] == counts[50] and "put" not in {kind for kind, _ in counts[50]}, counts
    # cat, find; mkdir, tar, sha256sum, mv x2 (two folders), rm; find; the manifest: mkdir, tar, sha256sum, mv, rm
    assert len(counts[50]) == 14 and [c for _, c in counts[50]].count("timeout") == 2, counts


def test_batched_and_per_file_sync_leave_the_same_tree_and_manifest(node, ssh, tmp_path, monkeypatch):
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    src = _model(tmp_path / "m", 4)
    (src / "large.bin").write_bytes(os.urandom(9 * 1024 * 1024))    # >= 8 MiB: the per-file push
    ct = ContainerTransport(ssh, CT)
    batched, per_file = f"/srv/pm/b-{os.getpid()}", f"/srv/pm/p-{os.getpid()}"
    one = sync_model(ct, "m", src, batched)
    monkeypatch.setattr(weights_send, "SMALL_FILE", 0)                # every file through put()
    two = sync_model(ct, "m", src, per_file)
    assert (one.files_sent, one.bytes_sent) == (two.files_sent, two.bytes_sent) == (8, one.bytes_total)
    assert _tree(ct, batched) == _tree(ct, per_file) == _local_tree(src)
    a, b = _manifest(ct, batched), _manifest(ct, per_file)
    assert a["files"] == b["files"] == local_manifest(src)
    assert {k: v[0] for k, v in a["observed"].items()} == {k: v[0] for k, v in b["observed"].items()}
    assert not ct.run(["sh", "-c", 'ls -a "$1" | grep incoming', "sh", batched]).stdout   # staging removed


@pytest.mark.parametrize("where", ["node over ssh", "this machine"])
def test_the_batched_sync_over_plain_ssh_and_locally(where, pve1_transport, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    src = _model(tmp_path / "m", 12)
    t = pve1_transport if where == "node over ssh" else LocalTransport()
    folder = f"/tmp/ddt-pm-{os.getpid()}-{where.split()[0]}"
    try:
        assert sync_model(t, "m", src, folder).files_sent == 15
        assert _tree(t, folder) == _local_tree(src)
        (src / "sub" / "deeper" / "config.json").write_text('{"seed": "b"}')    # same size: hashed, sent
        res = sync_model(t, "m", src, folder)
        assert (res.files_sent, res.bytes_sent) == (1, 13) and _tree(t, folder) == _local_tree(src)
    finally:
        t.run(["rm", "-rf", "--", folder])


def test_a_dead_runs_staging_folder_is_ignored_then_removed_when_stale(node, ssh, tmp_path, monkeypatch):
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    src = _model(tmp_path / "m", 3)
    ct = ContainerTransport(ssh, CT)
    folder = f"/srv/pm/stale-{os.getpid()}"
    sync_model(ct, "m", src, folder)
    script = ('mkdir -p "$1/.incoming-dead" "$1/.incoming-live" && echo x > "$1/.incoming-dead/pkg00-1.0-py3-none-any.whl"'
              ' && echo y > "$1/.incoming-live/half" && touch -d "2 hours ago" "$1/.incoming-dead"')
    ct.run(["sh", "-c", script, "sh", folder]).check()
    (src / "pkg01-1.0-py3-none-any.whl").write_bytes(b"new")
    res = sync_model(ct, "m", src, folder)
    assert (res.files_sent, res.bytes_sent) == (1, 3)
    left = ct.run(["ls", "-a", folder]).text.split()
    assert ".incoming-dead" not in left and ".incoming-live" in left      # a live run's folder is kept
    assert set(_manifest(ct, folder)["observed"]) == set(local_manifest(src))
    assert {k: v for k, v in _tree(ct, folder).items() if not k.startswith(".")} == _local_tree(src)


def test_batches_are_bounded_by_bytes_and_argv_length():
    from ddtctl.remote import push_many as pm

    mib = 1024 * 1024
    items = [(Path(f"/x/{i}"), f"f{i}", "") for i in range(4)]
    assert pm.batches(items, [30 * mib, 30 * mib, 30 * mib, 100 * mib]) == [[0, 1], [2], [3]]
    many = [(Path("/x"), "n" * 100 + str(i), "") for i in range(1000)]
    groups = pm.batches(many, [1] * 1000)
    assert [i for g in groups for i in g] == list(range(1000)) and len(groups) == 3
    assert all(sum(len(many[i][1]) + 80 for i in g) <= pm.ARGV_BYTES for g in groups)
    argvs = pm._place_argvs("/w", "/w/.incoming-1", [(Path(), "a.whl", ""), (Path(), "s/t/c.json", ""),
                                                     (Path(), "b.whl", "")])
    assert argvs == [["mv", "-f", "-t", "/w", "--", "/w/.incoming-1/a.whl", "/w/.incoming-1/b.whl"],
                     ["mv", "-f", "-t", "/w/s/t", "--", "/w/.incoming-1/s/t/c.json"]]
