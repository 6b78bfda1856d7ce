"""On the test fleet: `ddtctl exec` is a real remote command through real sshd ->
the node's shell -> `pct exec` (emulation) -> the container: every byte value passes both ways,
stdin (and its EOF) is forwarded, output streams as it comes, the exit status is relayed,
`--timeout` stops the command in the container (124) and Ctrl-C ends it (130)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import pytest

from tests.fleet.faults import FaultFleet
from tests.fleet.node import fleet_available

pytestmark = pytest.mark.fleet
BLOB = bytes(range(256)) * 512 + os.urandom(256 * 1024) + b"\xff\xfe\x00\r\n\x1b[0m"


@pytest.fixture(scope="module")
def xf(tmp_path_factory):
    reason = fleet_available()
    if reason:
        pytest.skip(reason)
    return FaultFleet(tmp_path_factory.mktemp("exec")).start()


def _alive(marker: str) -> bool:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return any(line.strip() == f"sleep {marker}" for line in out.splitlines())


def test_every_byte_value_round_trips_stdin_to_stdout_and_stderr(xf):
    res = xf.ddtctl("exec", "ct311", "--", "cat", stdin=BLOB)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout == BLOB                                     # byte-identical, same length
    res = xf.ddtctl("exec", "ct311", "--", "sh", "-c", "cat >&2", stdin=BLOB)
    assert res.returncode == 0 and res.stdout == b"" and res.stderr == BLOB


def test_stdin_eof_reaches_the_command(xf):
    res = xf.ddtctl("exec", "ct311", "--", "sh", "-c", "cat; echo done", stdin=b"abc")
    assert (res.returncode, res.stdout) == (0, b"abcdone\n"), res.stderr


@pytest.mark.parametrize("code", [0, 1, 42])
def test_the_exit_status_is_relayed(xf, code):
    res = xf.ddtctl("exec", "ct311", "--", "sh", "-c", f"echo out; exit {code}")
    assert (res.returncode, res.stdout) == (code, b"out\n"), res.stderr


def test_output_streams_while_the_command_runs(xf):
    proc = xf.popen("exec", "ct311", "--", "sh", "-c", "echo first; sleep 4; echo second")
    t0 = time.monotonic()
    try:
        assert proc.stdout.readline() == b"first\n"
        first = time.monotonic() - t0
        assert proc.stdout.readline() == b"second\n"
        assert proc.wait(20) == 0
    finally:
        proc.kill()
    assert first < 3.5 and time.monotonic() - t0 >= 4, first    # the first line came before the end


def test_timeout_stops_the_command_in_the_container(xf):
    marker = f"100.{uuid.uuid4().int % 10**6}"
    t0 = time.monotonic()
    res = xf.ddtctl("exec", "--timeout", "2", "ct311", "--", "sleep", marker, timeout=60)
    assert res.returncode == 124, res.stderr
    assert 2 <= time.monotonic() - t0 < 15
    deadline = time.monotonic() + 5
    while _alive(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(marker)                                     # stopped, not left running


def test_ctrl_c_ends_exec_with_130(xf):
    proc = xf.popen("exec", "ct311", "--", "sh", "-c", "echo started; exec sleep 60", start_new_session=True)
    try:
        assert proc.stdout.readline() == b"started\n"
        os.killpg(proc.pid, signal.SIGINT)                        # what the terminal does on Ctrl-C
        code = proc.wait(10)
    finally:
        proc.kill()
    err = proc.stderr.read().decode()
    assert code == 130 and "Traceback" not in err, err
