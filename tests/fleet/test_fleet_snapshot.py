"""The fleet's ddtctl runs from the snapshot, never from the live checkout (stable release identity)."""

from __future__ import annotations

from pathlib import Path

from tests.fleet.fleet import Fleet


def test_ddtctl_and_server_sources_come_from_the_snapshot(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / "fleet")
    fleet.base.mkdir()
    src = fleet.snapshot()
    res = fleet.python("-c", "import ddtctl; from ddtctl.ops.bundle import server_source_dir, source_identity; "
                             "print(ddtctl.__file__); print(server_source_dir()); print(source_identity().version_id)",
                       timeout=60)
    assert res.returncode == 0, res.stderr
    module, server, version = res.stdout.split()
    assert Path(module).is_relative_to(src) and Path(server) == src / "server"
    # identity of the snapshot is unchanged by files Python or an editor leave in it
    (src / "server" / "ddtree_server" / ".app.py.swp").write_bytes(b"x")
    (src / "server" / "ddtree_server" / "__pycache__").mkdir(exist_ok=True)
    (src / "server" / "ddtree_server" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"x")
    again = fleet.python("-c", "from ddtctl.ops.bundle import source_identity; print(source_identity().version_id)",
                         timeout=60)
    assert again.stdout.split() == [version], again.stderr
