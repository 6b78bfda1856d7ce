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
