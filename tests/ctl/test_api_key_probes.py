"""A server that wants an API key the operator has not set: `status`, `smoke` and
`wait-ready` report an authentication failure at once, exit 3, never `ok`, never `KeyError: 'data'`,
never a wait until the readiness deadline.

On the local host (no node involved): the real ddtree-server (embedded SmolLM2, CPU) runs under
ddtctl's local supervisor with DDTREE_API_KEY set; the inventory names the operator's variable
(`api_key_env: DDT_TEST_API_KEY`), which is unset for the faulty calls and set for the control.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ddtctl.ops.supervisor import LocalSupervisor
from ddtctl.ops.units import ServiceSpec, render_local
from tests.server.serverproc import THREAD_ENV

pytestmark = pytest.mark.slow
KEY_VAR, KEY = "DDT_TEST_API_KEY", "sk-test-key-4711"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    home = tmp_path_factory.mktemp("keyed")
    port = _free_port()
    inventory = home / "inventory.yaml"
    inventory.write_text(f"local:\n  here:\n    service: {{kind: ddtree, port: {port}, device: cpu, dtype: fp32, "
                         f"api_key_env: {KEY_VAR}, ready_timeout_s: 600}}\n")
    sup = LocalSupervisor(home / "supervisor" / "here", stop_timeout_s=30)
    sup.activate()
    argv = [sys.executable, "-m", "ddtree_server", "serve", "--port", str(port), "--device", "cpu", "--dtype", "fp32"]
    sup.spec_file.write_text(render_local(ServiceSpec("ddtree.service", "ddtree", "keyed test server", argv,
                                                      {"DDTREE_API_KEY": KEY, **THREAD_ENV}, str(home / "unused.env"),
                                                      working_dir=str(home))))
    sup.start()
    try:
        deadline = time.monotonic() + 600
        while True:
            assert sup.state().active == "active", sup.logs(40)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, sup.logs(40)
            time.sleep(1)
        env = {k: v for k, v in os.environ.items() if k != KEY_VAR}
        env.update(DDTCTL_HOME=str(home), DDTCTL_INVENTORY=str(inventory), NO_COLOR="1", COLUMNS="200")
        yield env
    finally:
        sup.stop()


def ddtctl(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddtctl", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=Path(env["DDTCTL_HOME"]))


def test_status_is_an_authentication_failure_not_ok(keyed):
    res = ddtctl(keyed, "status", "here", "--json", "--no-gpu")
    (host,) = json.loads(res.stdout)["hosts"]
    assert res.returncode == 3 and not host["ok"] and host["auth_failed"], (res.stderr, host)
    assert host["verdict"] == "auth failed" and f"${KEY_VAR}" in host["cause"] and "401" in host["cause"]
    assert "auth failed" in next(line for line in res.stderr.splitlines() if line.startswith("│ here"))
    good = ddtctl({**keyed, KEY_VAR: KEY}, "status", "here", "--json", "--no-gpu")
    assert good.returncode == 0 and json.loads(good.stdout)["hosts"][0]["ok"], good.stderr   # the key was all


def test_smoke_says_authentication_failed(keyed):
    res = ddtctl(keyed, "smoke", "here")
    assert res.returncode == 3, res.stderr
    assert "authentication failed" in res.stderr and f"${KEY_VAR}" in res.stderr
    assert "KeyError" not in res.stderr and "Traceback" not in res.stderr
    assert "here: here:" not in res.stderr


def test_wait_ready_fails_at_once(keyed):
    started = time.monotonic()
    res = ddtctl(keyed, "wait-ready", "here", "--timeout", "600", timeout=60)
    assert res.returncode == 3 and time.monotonic() - started < 30, res.stderr
    assert "authentication failed: /v1/models 401" in res.stderr and f"${KEY_VAR}" in res.stderr
