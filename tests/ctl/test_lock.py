"""The host lock (ddtctl/ops/lock.py) on the real LocalTransport and real mkdir/tee/rm, and a
real `deploy_host` that meets a held lock: it stops before changing anything (exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtctl.errors import ExitCode
from ddtctl.ops.lock import HostLocked, host_lock, lock_path
from ddtctl.remote.transport import LocalTransport


def test_lock_is_exclusive_names_its_holder_and_is_released(tmp_path: Path) -> None:
    t, root = LocalTransport(), str(tmp_path / "host")
    with host_lock(t, root, "deploy") as path:
        assert path == lock_path(root) and Path(path).is_dir()
        owner = (Path(path) / "owner").read_text()
        assert ": deploy since " in owner and " pid " in owner
        with pytest.raises(HostLocked) as err:
            with host_lock(t, root, "rollback"):
                pass  # pragma: no cover
        assert owner.strip() in str(err.value) and "--break-lock" in str(err.value)
        assert err.value.exit_code == ExitCode.HOST_FAILED
        assert Path(path).is_dir()  # the loser removed nothing
    assert not Path(lock_path(root)).exists()


def test_lock_is_released_when_the_block_fails(tmp_path: Path) -> None:
    t, root = LocalTransport(), str(tmp_path / "host")
    with pytest.raises(RuntimeError):
        with host_lock(t, root, "deploy"):
            raise RuntimeError("deploy step failed")
    assert not Path(lock_path(root)).exists()


def test_stale_lock_blocks_until_broken(tmp_path: Path) -> None:
    t, root = LocalTransport(), str(tmp_path / "host")
    Path(lock_path(root)).mkdir(parents=True)  # left by a killed run, no owner file
    with pytest.raises(HostLocked, match="unknown holder"):
        with host_lock(t, root, "deploy"):
            pass  # pragma: no cover
    with host_lock(t, root, "deploy", break_lock=True) as path:
        assert "deploy" in (Path(path) / "owner").read_text()


def test_deploy_meeting_a_held_lock_changes_nothing(tmp_path: Path, monkeypatch) -> None:
    from ddtctl.inventory import parse_inventory
    from ddtctl.ops.deploy import deploy_host

    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    inv = parse_inventory("local:\n  local:\n    service:\n      kind: ddtree\n      port: 18999\n",
                          tmp_path / "inventory.yaml")
    host = inv.select(["local"])[0]
    Path(lock_path(host.root)).mkdir(parents=True)
    (Path(lock_path(host.root)) / "owner").write_text("ops@laptop pid 7: deploy since 2026-11-30T05:00:00Z\n")
    result = deploy_host(host, LocalTransport(), bundle=object())
    assert isinstance(result.error, HostLocked) and "ops@laptop pid 7" in str(result.error)
    assert [p.name for p in Path(host.root).iterdir()] == [".ddtctl.lock"]  # no release, no unit
    assert result.to_dict()["exit_code"] == 1 and not result.changed


def test_a_lock_broken_and_retaken_by_another_run_is_not_removed_by_the_first(tmp_path: Path) -> None:
    t, root = LocalTransport(), str(tmp_path / "host")
    with host_lock(t, root, "deploy") as path:
        with host_lock(t, root, "deploy", break_lock=True):  # a second operator breaks in
            owner2 = (Path(path) / "owner").read_text()
            assert owner2.count(": deploy since") == 1
            (Path(path) / "owner").write_text("ops@other pid 9: deploy since later\n")  # ... as another process
    assert Path(path).is_dir()  # neither run removed a lock whose owner line is not its own
    assert (Path(path) / "owner").read_text().startswith("ops@other pid 9")


def test_automatic_rollback_restores_current_and_previous(tmp_path: Path, monkeypatch) -> None:
    """current=A, previous=B; a deploy of C whose server cannot start rolls back to current=A AND
    previous=B (not previous=A), and releases the lock."""
    import types

    from ddtctl.inventory import parse_inventory
    from ddtctl.ops import releases
    from ddtctl.ops.deploy import deploy_host
    from tests.ctl.release_stub import stub_release

    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    inv = parse_inventory("local:\n  local:\n    service:\n      kind: ddtree\n      port: 18998\n"
                          "      ready_timeout_s: 5\n", tmp_path / "inventory.yaml")
    host = inv.select(["local"])[0]
    t, layout = LocalTransport(), releases.Layout(host.root, host.unit)
    for vid in ("0.1.0-a", "0.1.0-b", "0.1.0-c"):  # installed releases without a runnable server
        stub_release(host, vid)
    releases.switch(t, layout, "0.1.0-b")
    releases.switch(t, layout, "0.1.0-a")
    result = deploy_host(host, t, bundle=types.SimpleNamespace(version_id="0.1.0-c"), smoke=False, timeout_s=5)
    assert not result.ok and result.rolled_back, result.steps
    assert releases.read_link(t, layout.current) == "0.1.0-a"
    assert releases.read_link(t, layout.previous) == "0.1.0-b"
    assert not Path(lock_path(host.root)).exists()


def test_ctrl_c_stops_a_deploy_at_a_step_boundary_and_releases_the_lock(tmp_path: Path, monkeypatch) -> None:
    import types

    from ddtctl import cancel
    from ddtctl.inventory import parse_inventory
    from ddtctl.ops.deploy import deploy_host

    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    inv = parse_inventory("local:\n  local:\n    service:\n      kind: ddtree\n      port: 18997\n",
                          tmp_path / "inventory.yaml")
    host = inv.select(["local"])[0]
    cancel.request()
    try:
        result = deploy_host(host, LocalTransport(), bundle=types.SimpleNamespace(version_id="0.1.0-z"))
    finally:
        cancel.reset()
    assert isinstance(result.error, cancel.Interrupted) and result.to_dict()["exit_code"] == 130
    assert "before the release step" in str(result.error)
    assert [p.name for p in Path(host.root).iterdir()] == []  # nothing installed, lock released
