"""Releases are immutable: a failed deploy of any class leaves the running release as it was, and
the service comes back when it is restarted afterwards (on the test fleet over real SSH).

One container (ct330 on its own node, shared with test_recovery.py: tests/fleet/fleet_fixtures.py)
serves the real SmolLM2 (embedded default model) from a release of this checkout. Each deploy
changes the service's dependencies (adding `target:` drops the embedded model's wheel from what
the release needs; `pip_args` change how it is installed), so it must make a NEW release, and
fails it one way:
* a model file that does not exist (no `source:`), then a dependency install that fails (pip
  refuses an option): neither restarts the service, so one restart follows both;
* a corrupt GGUF pushed as the target (the server cannot load it);
* a readiness deadline that passes (`--timeout 1`).
After each: `current` is the good release, whose manifest, console script and folder are
byte-for-byte and inode-for-inode as before; then `wait-ready` must succeed after a restart (the
rollback's own restart, else `ddtctl restart`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.fleet.fleet import Fleet
from tests.fleet.fleet_fixtures import ONE, ROOT, link, put_back

pytestmark = [pytest.mark.fleet, pytest.mark.slow]
CT = ONE.name


def ddtctl(fleet: Fleet, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "ddtctl", *args], env=fleet.env(), capture_output=True, text=True,
                         cwd=fleet.base, timeout=timeout, stdin=subprocess.DEVNULL)
    print(f"ddtctl {' '.join(args)}: exit {res.returncode}\n{res.stderr[-3000:]}")
    return res


def deploy(fleet: Fleet, overrides: dict, *args: str) -> tuple[int, dict]:
    inv = fleet.write_inventory(fleet.base / "changed.yaml", {CT: overrides})
    res = ddtctl(fleet, "deploy", CT, "--no-smoke", "--json", "-i", str(inv), *args)
    return res.returncode, json.loads(res.stdout)["hosts"][0]


def fingerprint(fleet: Fleet, release: str) -> str:
    """Inode, mtime (ns), size and sha256 of the release folder, its manifest and console script."""
    rel = f"{ROOT}/releases/{release}"
    files = [rel, f"{rel}/.ddtctl-release.json", f"{rel}/venv/bin/ddtree-server", f"{rel}/venv/pyvenv.cfg"]
    stat = fleet.exec(CT, "stat", "-c", "%n %i %.9Y %s", *files)
    sums = fleet.exec(CT, "sha256sum", *files[1:])
    assert stat.returncode == 0 and sums.returncode == 0, stat.stderr + sums.stderr
    return stat.stdout + sums.stdout


@pytest.fixture(scope="module")
def ifleet(one_ct_fleet):
    put_back(one_ct_fleet)
    return one_ct_fleet


@pytest.fixture
def before(ifleet):
    """The good release is current and active; yields its fingerprint, then checks the failed
    deploy left it untouched and that a restart brings the service back."""
    show = ifleet.show(CT)
    assert link(ifleet, "current") == ifleet.good and show["ActiveState"] == "active"
    print_ = fingerprint(ifleet, ifleet.good)
    yield print_
    assert link(ifleet, "current") == ifleet.good
    assert fingerprint(ifleet, ifleet.good) == print_, "the running release was modified"
    if ifleet.show(CT).get("MainPID") == show.get("MainPID"):   # a rollback restarted it already: no second restart
        res = ddtctl(ifleet, "restart", CT)
        assert res.returncode == 0, res.stderr
    res = ddtctl(ifleet, "wait-ready", CT, "--timeout", "300")
    assert res.returncode == 0, res.stderr


def _steps(host: dict) -> dict:
    return {s["name"]: s for s in host["steps"]}


def test_a_missing_model_file_then_a_failed_dependency_install(ifleet, before):
    """Two classes that fail before any restart, back to back: the release is checked untouched
    after each, and the one restart of the `before` fixture follows both (a second start of
    SmolLM2 would find nothing the first does not: neither deploy rewrites what the other left)."""
    code, host = deploy(ifleet, {"target": {"path": "/srv/models/missing.gguf"}, "model_id": "m"})
    steps = _steps(host)
    assert code == 1 and steps["weights:target"]["status"] == "failed", host["steps"]
    assert "model target not found at /srv/models/missing.gguf" in host["error"]
    assert host["release"] != ifleet.good and steps["current"]["status"] == "changed"   # a new release ...
    assert host["rolled_back"] and host["current_release"] == ifleet.good               # ... switched back
    assert link(ifleet, "current") == ifleet.good
    assert fingerprint(ifleet, ifleet.good) == before, "the running release was modified"
    _failed_dependency_install(ifleet)


def test_a_corrupt_gguf(ifleet, before):
    bad = ifleet.base / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(1 << 20))
    code, host = deploy(ifleet, {"target": {"path": "/srv/models/corrupt.gguf", "source": str(bad)},
                                 "model_id": "m"})
    steps = _steps(host)
    assert code == 1 and steps["weights:target"]["status"] == "changed", host["steps"]
    assert host["release"] != ifleet.good and host["rolled_back"], host["steps"]
    assert steps["rollback"]["status"] == "changed" and host["service"].startswith("active"), host


def _failed_dependency_install(ifleet):
    code, host = deploy(ifleet, {"packages": {"mode": "system", "pip_args": ["--no-such-pip-option"]}})
    steps = _steps(host)
    assert code == 1 and steps["release"]["status"] == "failed", host["steps"]
    assert "no such option: --no-such-pip-option" in host["error"]
    assert host["release"] != ifleet.good and "current" not in steps and not host["restarted"]
    listing = ifleet.exec(CT, "ls", f"{ROOT}/releases").stdout.split()
    assert host["release"] not in listing                       # the half-made release is removed


def test_a_failed_readiness(ifleet, before):
    code, host = deploy(ifleet, {"packages": {"mode": "system", "pip_args": ["--no-compile"]}}, "--timeout", "1")
    steps = _steps(host)
    assert code == 4 and steps["wait-ready"]["status"] == "failed", host["steps"]
    assert host["release"] != ifleet.good and steps["release"]["status"] == "changed"   # installed beside it
    assert host["rolled_back"] and steps["rollback"]["status"] == "changed", host["steps"]
