"""On the test fleet: a node that stops answering never hangs ddtctl.

A node is frozen with SIGSTOP on its sshd processes (tests/fleet/sshd.py: the TCP connections stay
open, the kernel still completes new TCP handshakes, nothing answers) at connect, in the middle of
a command and in the middle of a push; the host ends "unreachable (no answer in N s)" with exit 3
within the short deadlines of tests/fleet/faults.py while the other node's host finishes, and a
host lock the frozen node kept is taken over as stale by the next run on this machine.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from tests.fleet.faults import BLOB_PATH, FaultFleet
from tests.fleet.node import fleet_available
from tests.fleet.sshd import freeze, thaw

pytestmark = pytest.mark.fleet
LOCK = "/opt/ddtree/.ddtctl.lock"


@pytest.fixture(scope="module")
def ff(tmp_path_factory):
    reason = fleet_available()
    if reason:
        pytest.skip(reason)
    fleet = FaultFleet(tmp_path_factory.mktemp("faults")).start()
    res = fleet.ddtctl("deploy", "--all", "--no-smoke", "--json", timeout=300)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    return fleet


def _frozen(ff, node: str, **kw):
    return freeze(ff.nodes[node].sshd, **kw)


def test_a_node_frozen_before_connect_is_unreachable_and_the_other_host_finishes(ff):
    pids = _frozen(ff, "fz-a")
    try:
        t0 = time.monotonic()
        res = ff.ddtctl("restart", "ct310", "ct311", timeout=60)
        took = time.monotonic() - t0
    finally:
        thaw(pids)
    err = res.stderr.decode()
    print(err)
    assert res.returncode == 3, err
    assert "ct310: node:fz-a: unreachable (no answer in 2 s)" in err, err
    assert "ct311: restart fake-ct311.service: active" in err, err
    assert "Traceback" not in err and took < 20


def test_a_node_frozen_in_the_middle_of_a_command_is_unreachable(ff):
    proc = ff.popen("exec", "ct310", "--", "sh", "-c", "echo started; exec sleep 60")
    try:
        assert proc.stdout.readline() == b"started\n"          # streamed before the command ends
        pids = _frozen(ff, "fz-a")
        t0 = time.monotonic()
        try:
            code = proc.wait(30)
        finally:
            thaw(pids)
    finally:
        proc.kill()
    err = proc.stderr.read().decode()
    assert code == 3, err
    assert "node:fz-a: unreachable (no answer in 2 s) while running pct" in err, err
    assert time.monotonic() - t0 < 15 and "Traceback" not in err


def test_a_node_frozen_in_the_middle_of_a_push_leaves_a_stale_lock_that_is_taken_over(ff):
    ff.new_blob()                                   # both containers need the new weights
    part = ff.private("ct310", BLOB_PATH + ".part")
    proc = ff.popen("deploy", "ct310", "ct311", "--no-smoke", "--json")
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not (part.exists() and part.stat().st_size > 0):  # ct310's dd is slowed: mid-push
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        pids = _frozen(ff, "fz-a")
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        thaw(pids)
        proc.kill()
    print(err.decode())
    hosts = {h["host"]: h for h in json.loads(out)["hosts"]}
    assert proc.returncode == 3, err.decode()[-3000:]
    assert hosts["ct311"]["ok"] and hosts["ct311"]["weights_bytes_sent"] > 0        # the other node finished
    bad = hosts["ct310"]
    assert not bad["ok"] and bad["exit_code"] == 3
    assert "unreachable (no answer in 2 s)" in bad["error"], bad["error"]
    assert f"the host lock {LOCK} was left behind" in bad["error"], bad["error"]
    assert took < 20, took
    # thawed: the lock of the run that lost its node is still there, its owner gone
    owner = ff.exec_in("ct310", "cat", f"{LOCK}/owner").stdout
    assert " deploy since " in owner and " start " in owner and " machine " in owner
    sent_before = part.stat().st_size
    res = ff.ddtctl("deploy", "ct310", "--no-smoke", "--json", timeout=120)
    h = json.loads(res.stdout)["hosts"][0]
    assert res.returncode == 0 and h["ok"], res.stderr.decode()[-3000:]
    lock_steps = [s for s in h["steps"] if s["name"] == "lock"]
    assert lock_steps and "took over the stale lock of" in lock_steps[0]["detail"], h["steps"]
    assert "no longer exists" in lock_steps[0]["detail"]
    assert 0 < h["weights_bytes_sent"] <= ff.blob.stat().st_size - sent_before + 8 * 1024 * 1024  # resumed
    assert ff.exec_in("ct310", "test", "-e", LOCK).returncode != 0
    digest = ff.exec_in("ct310", "sha256sum", BLOB_PATH).stdout.split()[0]
    assert digest == hashlib.sha256(ff.blob.read_bytes()).hexdigest()
