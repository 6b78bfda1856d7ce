"""An error line names its host once (`error: here: ...`, never `here: here:`),
whichever layer wrote the message (the transport of that host, a step of the deploy)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ddtctl.ops.bundle import source_identity

REPO = Path(__file__).resolve().parents[2]


def test_host_message_adds_the_host_only_when_missing() -> None:
    from ddtctl.report import host_message

    assert host_message("here", "boom") == "here: boom"
    assert host_message("here", "here: boom") == "here: boom"
    assert host_message("ct200", "ct200@pve1: command failed") == "ct200@pve1: command failed"
    assert host_message("ct2", "ct200@pve1: x") == "ct2: ct200@pve1: x"


def test_a_failed_local_deploy_names_the_host_once(tmp_path: Path) -> None:
    home = tmp_path / "home"
    cache = home / "cache" / "wheels" / source_identity().version_id
    cache.mkdir(parents=True)
    (cache / "ddtree_server-0.0.0-py3-none-any.whl").write_bytes(b"placeholder")
    inv = tmp_path / "inventory.yaml"
    inv.write_text("local:\n  here:\n    service: {kind: ddtree, port: 18412, python: /nonexistent/python3}\n")
    env = {**os.environ, "DDTCTL_INVENTORY": str(inv), "DDTCTL_HOME": str(home), "NO_COLOR": "1"}
    res = subprocess.run([sys.executable, "-m", "ddtctl", "deploy", "here", "--no-smoke"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert errors and all(line.startswith("error: here: ") for line in errors), res.stderr
    assert "here: here:" not in res.stderr and "/nonexistent/python3" in res.stderr
