"""Many containers per node share one SSH connection per node in a ddtctl run, and a channel that
closes just as its exit status arrives is a finished command, not a lost connection.

* `status --all` over a 2-node x 3-container fleet (tests/fleet/scale.py): each node's real sshd
  accepts exactly ONE login for the whole run (it was one per container).
* The close race (the cause of "connection lost while running pct: connection lost" during
  deploys): paramiko's `exit_status_ready()` is made to answer False one last time right after the
  channel was closed by the server (the interleaving a busy machine produces at random); the
  command must still return its exit status and output, and the other commands sharing the
  connection must be unaffected.
The timing of `status --all` over 32 containers is measured by `python -m tests.fleet.scale_bench`
(docs/benchmarks/status-scale*.md), never here.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import paramiko
import pytest

from tests.fleet.conftest import make_node, pve1, pve1_transport  # noqa: F401
from tests.fleet.node import fleet_available
from tests.fleet.scale import ScaleFleet


@pytest.fixture(scope="module")
def small_fleet(tmp_path_factory):
    reason = fleet_available()
    if reason:
        pytest.skip(reason)
    f = ScaleFleet(tmp_path_factory.mktemp("scale"), nodes=2, per_node=3).start()
    try:
        yield f
    finally:
        f.close()


def test_status_all_opens_one_connection_per_node(small_fleet):
    before = small_fleet.logins()
    res = small_fleet.ddtctl("status", "--all", "--json", "-p", "6", timeout=300)
    assert res.returncode == 1, res.stderr            # every service is stopped: not ok, reachable
    assert '"unreachable": true' not in res.stdout
    import time
    time.sleep(0.5)                                    # sshd logs the login line asynchronously
    after = small_fleet.logins()
    assert {n: after[n] - before[n] for n in after} == {"sc-0": 1, "sc-1": 1}


@pytest.fixture
def late_close(monkeypatch):
    """exit_status_ready() answers False once more after the channel closed (see module doc)."""
    original = paramiko.Channel.exit_status_ready
    seen: set[int] = set()
    lock = threading.Lock()

    def racy(chan):
        with lock:
            first = id(chan) not in seen
            seen.add(id(chan))
        if first and not original(chan):
            for _ in range(200):                       # wait until the server closed the channel
                if chan.closed:
                    return False                       # ... and answer as if checked just before
                threading.Event().wait(0.02)
        return original(chan)

    monkeypatch.setattr(paramiko.Channel, "exit_status_ready", racy)


def test_channel_closed_with_its_status_is_not_a_lost_connection(pve1_transport, late_close):  # noqa: F811
    res = pve1_transport.run(["sh", "-c", "sleep 0.2; echo out; echo err >&2; exit 3"], timeout=30)
    assert (res.exit_code, res.text, res.err_text) == (3, "out\n", "err\n")


def test_close_race_leaves_the_shared_connection_to_the_others(pve1_transport, late_close):  # noqa: F811
    def one(i: int):
        return pve1_transport.run(["sh", "-c", f"sleep 0.1; echo {i}"], timeout=30)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(24)))
    assert [r.text for r in results] == [f"{i}\n" for i in range(24)]
    assert all(r.exit_code == 0 for r in results)


def test_pct_list_columns() -> None:
    """`pct list` (pct.pm: `%-10s %-10s %-12s %-20s`, VMID Status Lock Name; Lock mostly blank)."""
    from ddtctl.ops.container import parse_list

    text = ("VMID       Status     Lock         Name                \n"
            "129        running                 ct129               \n"
            "200        stopped    backup       ct200               \n"
            "201        running                                     \n")
    assert parse_list(text) == {129: "running", 200: "stopped", 201: "running"}
    assert parse_list("") == {}


def test_one_pct_exec_answers_several_reads_byte_for_byte(small_fleet):
    """remote/batch.py: several commands in one `pct exec` give the results of running each alone
    (exit status, stdout and stderr bytes; values with quotes, `$(...)`, newlines reach argv as-is)."""
    from ddtctl.remote.batch import run_batch
    from ddtctl.remote.pct import ContainerTransport

    node = small_fleet.nodes["sc-0"].transport()
    ct = ContainerTransport(node, 500)
    argvs = [["printf", "%s|", "it's $(echo no) `echo no` \"q\"", "two\nlines", "-x"],
             ["sh", "-c", "printf 'a\\000b\\n'; echo err >&2; exit 3"],
             ["cat", "/nonexistent/file"],
             ["systemctl", "show", "fake-sc00.service", "-p", "ActiveState,SubState"],
             ["true"]]
    try:
        batched = run_batch(ct, argvs)
        alone = [ct.run(a, timeout=60) for a in argvs]
        assert batched is not None
        assert [(r.exit_code, r.stdout, r.stderr) for r in batched] == \
               [(r.exit_code, r.stdout, r.stderr) for r in alone]
        assert batched[0].stdout == b"it's $(echo no) `echo no` \"q\"|two\nlines|-x|" and batched[1].exit_code == 3
        missing = run_batch(ct, [["no-such-program-here"]])[0]
        assert missing.exit_code == 127 and b"No such file or directory" in missing.stderr
        small_fleet.nodes["sc-0"].pct("stop", "501")
        assert run_batch(ContainerTransport(node, 501), [["true"]]) is None     # pct's failure: run singly
    finally:
        small_fleet.nodes["sc-0"].pct("start", "501", check=False)
        node.close()
