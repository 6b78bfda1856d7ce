"""The host lock (ddtctl/ops/lock.py) on the real LocalTransport and real mkdir/tee/rm, and a
real `deploy_host` that meets a held lock: it stops before changing anything (exit 1)."""

from __future__ import annotations

import os
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
    from tests.ctl.release_stub import deployed_id, stub_release

    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    inv = parse_inventory("local:\n  local:\n    service:\n      kind: ddtree\n      port: 18998\n"
                          "      ready_timeout_s: 5\n", tmp_path / "inventory.yaml")
    host = inv.select(["local"])[0]
    t, layout = LocalTransport(), releases.Layout(host.root, host.unit)
    for vid in ("0.1.0-a", "0.1.0-b", deployed_id(host, "0.1.0-c")):  # installed, no runnable server
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


def _owner_of_a_finished_process(command: str = "deploy") -> str:
    """The owner line a ddtctl process of this machine wrote before it exited."""
    import subprocess
    import sys

    code = f"from ddtctl.ops.lock import owner_line; print(owner_line({command!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def _lock_with_owner(root: str, owner: str) -> Path:
    path = Path(lock_path(root))
    path.mkdir(parents=True)
    (path / "owner").write_text(owner + "\n")
    return path


def test_owner_line_names_the_process_precisely_and_a_gone_owner_is_taken_over(tmp_path: Path) -> None:
    from ddtctl.ops.lock import machine_id, process_start

    if machine_id() is None or process_start(1) is None:
        pytest.skip("needs /etc/machine-id and /proc")
    t, root = LocalTransport(), str(tmp_path / "host")
    stale = _owner_of_a_finished_process()
    assert f" start {process_start(1).split(':')[0]}:" in stale and f" machine {machine_id()}: deploy since " in stale
    _lock_with_owner(root, stale)
    notes: list[str] = []
    with host_lock(t, root, "deploy", note=notes.append) as path:
        mine = (Path(path) / "owner").read_text().strip()
        assert mine != stale and f" pid {os.getpid()} " in mine
        assert not (Path(path) / ".takeover").exists()
    (note,) = notes
    assert note.startswith(f"took over the stale lock of {stale}") and "no longer exists" in note
    assert not Path(lock_path(root)).exists()


def test_a_live_owner_or_another_machine_keeps_its_lock(tmp_path: Path) -> None:
    import subprocess
    import sys

    from ddtctl.ops.lock import machine_id, process_start

    if machine_id() is None or process_start(1) is None:
        pytest.skip("needs /etc/machine-id and /proc")
    t = LocalTransport()
    code = "from ddtctl.ops.lock import owner_line; import sys, time; print(owner_line('deploy'), flush=True); time.sleep(60)"
    live = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        owner = live.stdout.readline().strip()
        root = str(tmp_path / "a")
        _lock_with_owner(root, owner)
        with pytest.raises(HostLocked, match=r"\(still running\)"):
            with host_lock(t, root, "deploy"):
                pass  # pragma: no cover
    finally:
        live.kill()
        live.wait()
    other = _owner_of_a_finished_process().replace(f" machine {machine_id()}", " machine " + "0" * 32)
    root = str(tmp_path / "b")
    _lock_with_owner(root, other)
    with pytest.raises(HostLocked, match=r"\(another machine\)"):
        with host_lock(t, root, "deploy"):
            pass  # pragma: no cover
    old_format = "ops@laptop pid 7: deploy since 2026-11-30T05:00:00Z"      # no start time: never judged
    root = str(tmp_path / "c")
    _lock_with_owner(root, old_format)
    with pytest.raises(HostLocked, match="ops@laptop pid 7"):
        with host_lock(t, root, "deploy"):
            pass  # pragma: no cover


def test_a_reused_pid_is_not_the_owner(tmp_path: Path) -> None:
    """Our own pid with another start time (the owner died and the pid was given to us)."""
    import re

    from ddtctl.ops.lock import machine_id, owner_line, process_start

    if machine_id() is None or process_start(1) is None:
        pytest.skip("needs /etc/machine-id and /proc")
    reused = re.sub(r" start (\w+):(\d+)", lambda m: f" start {m[1]}:{int(m[2]) - 1}", owner_line("deploy"))
    root = str(tmp_path / "host")
    _lock_with_owner(root, reused)
    notes: list[str] = []
    with host_lock(LocalTransport(), root, "deploy", note=notes.append):
        pass
    assert "its pid now belongs to another process" in notes[0]


def test_two_runs_taking_over_one_stale_lock_never_both_win(tmp_path: Path) -> None:
    import threading

    from ddtctl.ops.lock import machine_id, process_start

    if machine_id() is None or process_start(1) is None:
        pytest.skip("needs /etc/machine-id and /proc")
    for attempt in range(5):
        root = str(tmp_path / f"host{attempt}")
        _lock_with_owner(root, _owner_of_a_finished_process())
        barrier, guard, lost = threading.Barrier(2), threading.Lock(), []
        state = {"active": 0, "peak": 0, "won": 0}

        def one() -> None:
            barrier.wait()
            try:
                with host_lock(LocalTransport(), root, "deploy"):
                    with guard:
                        state["active"] += 1
                        state["won"] += 1
                        state["peak"] = max(state["peak"], state["active"])
                    threading.Event().wait(0.3)
                    with guard:
                        state["active"] -= 1
            except HostLocked as exc:
                lost.append(str(exc))

        threads = [threading.Thread(target=one) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert state["peak"] == 1 and state["won"] >= 1 and state["won"] + len(lost) == 2, (state, lost)
        assert not Path(lock_path(root)).exists()
