"""The pure parts of "status tells the truth" and "never leave a service down": pct's own failures told
apart from the command's, the start limit read from systemd's journal, connection failures in
words, the verdict a status row shows. Real-format samples; the fleet tests run the same code
against the emulated pct/systemd over real SSH."""

from __future__ import annotations

import pytest

from ddtctl.ops.container import pct_failure
from ddtctl.ops.gpu import GpuInfo
from ddtctl.ops.status import HostStatus, unreachable_cause
from ddtctl.ops.unitstate import UnitState, parse_show, start_limit_in_journal
from ddtctl.report import gpu_cell


@pytest.mark.parametrize(("code", "stderr", "state", "words"), [
    (255, "container '200' not running!\n", "stopped", "container stopped"),
    (255, "Configuration file 'nodes/pve1/lxc/999.conf' does not exist\n", "absent",
     "container 999 does not exist on node pve1"),
    (255, "can only push files to a running CT\n", "stopped", "container stopped"),
    (127, "bash: line 1: pct: command not found\n", "no-pct", "pct not found on the node"),
    (127, "bash: pct: command not found\n", "no-pct", "pct not found on the node"),
])
def test_pct_failures_are_recognised(code: int, stderr: str, state: str, words: str) -> None:
    found = pct_failure(code, stderr)
    assert found is not None and found.state == state and words in found.detail and not found.running


@pytest.mark.parametrize(("code", "stderr"), [
    (0, ""),
    (255, "Failed to initialize NVML: Unknown Error\n"),      # nvidia-smi's own 255: a GPU problem
    (127, "/usr/bin/env: 'nvidia-smi': No such file or directory\n"),   # missing IN the container
    (1, "container '200' not running!\n"),                      # not pct's exit status
])
def test_the_commands_own_failures_are_not_pcts(code: int, stderr: str) -> None:
    assert pct_failure(code, stderr) is None


JOURNAL_LIMIT = """\
Starting ddtree-server for ct200...
ddtree-ct200.service: Main process exited, code=exited, status=1/FAILURE
ddtree-ct200.service: Failed with result 'exit-code'.
ddtree-ct200.service: Scheduled restart job, restart counter is at 5.
Stopped ddtree-server for ct200.
ddtree-ct200.service: Start request repeated too quickly.
ddtree-ct200.service: Failed with result 'exit-code'.
Failed to start ddtree-server for ct200.
"""


def test_start_limit_is_read_from_the_journal_after_the_last_start() -> None:
    assert start_limit_in_journal(JOURNAL_LIMIT, "ddtree-ct200.service")
    later = JOURNAL_LIMIT + "Starting ddtree-server for ct200...\nStarted ddtree-server for ct200.\n"
    assert not start_limit_in_journal(later, "ddtree-ct200.service")
    assert not start_limit_in_journal(JOURNAL_LIMIT, "other.service")


def test_unit_state_in_words() -> None:
    st = parse_show("ActiveState=failed\nSubState=failed\nResult=exit-code\nNRestarts=5\nMainPID=0\n")
    assert st.describe() == "failed [Result: exit-code; 5 automatic restarts]"
    assert UnitState("failed", "failed", "exit-code", 0, None, True).describe() == \
        "failed [Result: exit-code; start limit hit]"
    assert UnitState("failed", "failed", "start-limit-hit").describe() == "failed [Result: start-limit-hit]"
    assert UnitState("activating", "auto-restart", "exit-code", 1).describe() == \
        "activating (auto-restart) [Result: exit-code; 1 automatic restart]"
    assert UnitState("active", "running", "success").to_dict()["description"] == "active (running)"


@pytest.mark.parametrize(("message", "cause"), [
    ("node:pve1: cannot connect: root@10.0.0.5:22: SSHException('Error reading SSH protocol banner')",
     "no SSH banner in 10 s"),
    ("node:pve1: cannot connect: root@10.0.0.5:22: SSHException('No existing session')",
     "SSH handshake not completed in 10 s"),
    ("node:pve1: cannot connect: root@10.0.0.5:22: NoValidConnectionsError(None, 'Unable to connect to port 22 "
     "on 10.0.0.5')", "connection refused"),
    ("node:pve1: cannot connect: root@10.0.0.5:22: ConnectionRefusedError(111, 'Connection refused')",
     "connection refused"),
    ("node:pve1: cannot connect: root@10.0.0.5:22: TimeoutError('timed out')", "no answer in 10 s"),
    ("node:pve1: authentication failed for root@10.0.0.5:22: Authentication failed.", "SSH authentication failed"),
    ("node:pve1: cannot connect: something new", "something new"),
])
def test_connection_failures_in_words(message: str, cause: str) -> None:
    assert unreachable_cause(message, 10.0) == cause


def test_verdicts() -> None:
    ok = HostStatus("a", "ddtree", unit={"active": "active"}, ready=True, container={"state": "running", "detail": ""})
    assert (ok.ok, ok.verdict, ok.cause) == (True, "ok", "")
    stopped_ct = HostStatus("b", "ddtree", ready=True, container={"state": "stopped", "detail": "container stopped"})
    assert (stopped_ct.ok, stopped_ct.verdict) == (False, "container stopped")      # HTTP answering is not enough
    auth = HostStatus("c", "ddtree", ready=True, auth_failed=True,
                      errors=["http: authentication failed: /v1/models 401: set $K"])
    assert (auth.ok, auth.verdict, auth.cause) == (False, "auth failed", "authentication failed: /v1/models 401: set $K")
    gone = HostStatus("d", "ddtree", ready=False, unreachable=True, unreachable_cause="connection refused")
    assert (gone.verdict, gone.cause) == ("unreachable", "connection refused")
    assert gone.to_dict()["verdict"] == "unreachable"


def test_gpu_cell_shows_tokens_with_their_meaning() -> None:
    row = GpuInfo(0, "NVIDIA H100", 81920, "[N/A]", "[N/A]", "570.133.20", "Enabled").to_dict()
    cell = gpu_cell([row], None)
    assert cell == "0: [N/A]/81920 MiB [N/A] ([N/A]: MIG mode)"
    assert gpu_cell([{"index": 1, "memory_used_mib": 1024, "memory_total_mib": 143771, "utilization_pct": 3}],
                    None) == "1: 1024/143771 MiB 3%"
    assert gpu_cell(None, {"problem": "no GPU visible"}) == "no GPU visible"


def test_start_limit_hit_in_json_agrees_with_result_start_limit_hit() -> None:
    """systemd 253+ reports the refused start as Result=start-limit-hit: the JSON flag says so too."""
    state = parse_show("LoadState=loaded\nActiveState=failed\nSubState=failed\nResult=start-limit-hit\n")
    doc = state.to_dict()
    assert (doc["result"], doc["start_limit_hit"], doc["failed"]) == ("start-limit-hit", True, True)
    assert state.describe() == "failed [Result: start-limit-hit]"


def test_a_unit_systemd_does_not_know_is_not_installed() -> None:
    """`systemctl show` of a unit without a file exits 0 with LoadState=not-found and
    ActiveState=inactive: not `stopped`, `not installed`."""
    state = parse_show("MainPID=0\nResult=success\nNRestarts=0\nLoadState=not-found\nActiveState=inactive\n"
                       "SubState=dead\n")
    assert not state.installed and state.to_dict()["installed"] is False
    assert state.describe() == "not installed (LoadState=not-found)"
    st = HostStatus("ct1", "ddtree", unit=state.to_dict(), ready=False, ready_detail="x is not installed")
    assert (st.verdict, st.cause, st.stopped) == ("not installed", "x is not installed", True)
