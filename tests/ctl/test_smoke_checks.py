"""Smoke checks against something that is not a model server (a real `python -m http.server`):
every check fails cleanly (no exception escapes), the CLI exits 5, the JSON names each check.
The passing path against the real ddtree-server is in test_local_deploy.py (slow)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ddtctl.cli.app import app
from ddtctl.errors import SmokeFailed
from ddtctl.inventory_schema import DdtreeService, Host
from ddtctl.ops.smoke import Check, SmokeReport, require_ok, run_smoke
from ddtctl.remote.transport import LocalTransport

CHECKS = ["models", "chat_fact", "multi_turn", "raw_completion", "stream_equal", "tool_call", "json_schema",
          "stop_sequence", "bad_request_4xx", "acceptance"]


@pytest.fixture()
def not_a_model_server(tmp_path: Path) -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_every_check_fails_cleanly(not_a_model_server: int, tmp_path: Path) -> None:
    host = Host("here", "local", "127.0.0.1", str(tmp_path), DdtreeService(kind="ddtree", port=not_a_model_server))
    report = run_smoke(host, LocalTransport())
    assert [c.name for c in report.checks] == CHECKS
    statuses = {c.name: c.status for c in report.checks}
    assert statuses["models"] == "fail" and statuses["chat_fact"] == "fail"
    assert "answered 501" in next(c.detail for c in report.checks if c.name == "chat_fact")
    assert not report.ok
    with pytest.raises(SmokeFailed) as info:
        require_ok(report)
    assert info.value.exit_code == 5 and str(info.value).startswith("here: smoke failed: models:")


def test_cli_smoke_exit_5_and_json(not_a_model_server: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"local:\n  here:\n    service: {{kind: ddtree, port: {not_a_model_server}}}\n")
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    res = CliRunner().invoke(app, ["-i", str(inv), "smoke", "here", "--json"], catch_exceptions=False)
    assert res.exit_code == 5
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and [c["name"] for c in doc["hosts"][0]["checks"]] == CHECKS
    assert "smoke here" in res.stderr and "Traceback" not in res.output


def test_na_checks_do_not_fail_a_report() -> None:
    report = SmokeReport("h", [Check("models", "pass"), Check("acceptance", "n/a", "n/a (mode ar)")])
    assert report.ok and require_ok(report) is report
    assert report.to_dict()["checks"][1] == {"name": "acceptance", "status": "n/a", "detail": "n/a (mode ar)",
                                             "seconds": 0.0}


@pytest.fixture()
def wrong_model_listed(tmp_path: Path) -> Iterator[int]:
    """A real static file server whose GET /v1/models is a valid list naming another model: only the
    check itself (not a status code or a JSON error) can fail the `models` check."""
    root = tmp_path / "www"
    (root / "v1").mkdir(parents=True)
    (root / "v1" / "models").write_text(json.dumps({"object": "list", "data": [{"id": "some-other-model"}]}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_checks_fail_under_python_O(wrong_model_listed: int, tmp_path: Path) -> None:
    """`python -O` drops `assert` statements: the smoke checks must still fail (a real
    `python -O -m ddtctl smoke` process, exit 5, the `models` check names what is wrong)."""
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"local:\n  here:\n    service: {{kind: ddtree, port: {wrong_model_listed}}}\n")
    env = {**os.environ, "DDTCTL_HOME": str(tmp_path / "home"), "PYTHONOPTIMIZE": "1"}
    res = subprocess.run([sys.executable, "-O", "-m", "ddtctl", "-i", str(inv), "smoke", "here", "--json"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 5, res.stderr
    checks = {c["name"]: c for c in json.loads(res.stdout)["hosts"][0]["checks"]}
    assert checks["models"]["status"] == "fail"
    assert "lists ['some-other-model']" in checks["models"]["detail"]
    assert "Traceback" not in res.stderr
