"""On the `local` host: `ddtctl exec` (a real `python -m ddtctl` process) passes
every byte value both ways, forwards stdin and its EOF, streams output, relays the exit status,
stops the command's process group after `--timeout` (124, or 137 when it ignored SIGTERM) and
ends with 130 on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BLOB = bytes(range(256)) * 512 + os.urandom(256 * 1024) + b"\xff\xfe\x00\r\n"


@pytest.fixture()
def env(tmp_path: Path) -> dict:
    inv = tmp_path / "inventory.yaml"
    inv.write_text("local:\n  here:\n    service: {kind: ddtree, port: 18411}\n")
    return {**os.environ, "DDTCTL_INVENTORY": str(inv), "DDTCTL_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}


def ddtctl(env: dict, *args: str, stdin: bytes = b"", timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddtctl", *args], env=env, cwd=REPO, input=stdin,
                          capture_output=True, timeout=timeout)


def _alive(marker: str) -> bool:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return any(line.strip() == f"sleep {marker}" for line in out.splitlines())


def test_bytes_stdin_eof_and_exit_status(env):
    res = ddtctl(env, "exec", "here", "--", "cat", stdin=BLOB)
    assert res.returncode == 0 and res.stdout == BLOB, res.stderr[-500:]
    res = ddtctl(env, "exec", "here", "--", "sh", "-c", "cat >&2; exit 42", stdin=BLOB)
    assert res.returncode == 42 and res.stderr == BLOB and res.stdout == b""
    res = ddtctl(env, "exec", "here", "--", "sh", "-c", "cat; echo done", stdin=b"abc")
    assert (res.returncode, res.stdout) == (0, b"abcdone\n")


def test_output_streams_while_the_command_runs(env):
    proc = subprocess.Popen([sys.executable, "-m", "ddtctl", "exec", "here", "--", "sh", "-c",
                             "echo first; sleep 3; echo second"], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout.readline() == b"first\n"
        first = time.monotonic()
        assert proc.stdout.readline() == b"second\n"
        second = time.monotonic()
        assert proc.wait(20) == 0 and proc.stdout.read() == b""
    finally:
        proc.kill()
    # the first line arrived while the command still slept (measured between the two lines, so a
    # slow start of `python -m ddtctl` on a loaded machine does not count)
    assert second - first >= 2.0


def test_timeout_stops_the_whole_command(env):
    marker = f"100.{uuid.uuid4().int % 10**6}"
    t0 = time.monotonic()
    res = ddtctl(env, "exec", "--timeout", "1", "here", "--", "sh", "-c", f"sleep {marker} & wait")
    assert res.returncode == 124 and time.monotonic() - t0 < 10, res.stderr
    time.sleep(0.3)
    assert not _alive(marker)                       # the command's children were stopped too
    res = ddtctl(env, "exec", "--timeout", "1", "here", "--", "sh", "-c", "trap '' TERM; sleep 30")
    assert res.returncode == 137                    # ignored SIGTERM: killed 5 s later (timeout -k)


def test_ctrl_c_ends_exec_with_130(env):
    proc = subprocess.Popen([sys.executable, "-m", "ddtctl", "exec", "here", "--", "sh", "-c",
                             "echo started; exec sleep 60"], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert proc.stdout.readline() == b"started\n"
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(10)
    finally:
        proc.kill()
    assert code == 130 and b"Traceback" not in proc.stderr.read()
