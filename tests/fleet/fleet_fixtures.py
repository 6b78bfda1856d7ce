"""Session fixtures of the test fleets (tests/fleet/fleet.py): the 3-container fleet, and one
container shared by the modules that fail deploys on it.

Use them by importing into a test module: ``from tests.fleet.fleet_fixtures import fleet  # noqa: F401``
(tests/fleet/conftest.py belongs to the node fixtures; this module keeps the fleet apart from it).
The nodes are the process-wide shared nodes of tests/fleet/node.py (closed at exit); the fixture
stops its containers (pct stop kills every process in them, services included) at session end.
"""

from __future__ import annotations

import json

import pytest

from tests.fleet.fleet import CtSpec, Fleet
from tests.fleet.node import fleet_available


@pytest.fixture(scope="session")
def fleet(tmp_path_factory):
    reason = fleet_available()
    if reason:
        pytest.skip(reason)
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        yield f.start()
    finally:
        f.close()


# ---- one container, deployed once: test_immutable_releases.py and test_recovery.py ------------------
ONE = CtSpec("ct330", 330, "fleet-r", None, "h200")   # the embedded SmolLM2, from a release of this checkout
ROOT = "/opt/ddtree"


@pytest.fixture(scope="session")
def one_ct_fleet(tmp_path_factory):
    """ct330 on its own node serving a release of this checkout (`fleet.good`). Both modules fail
    deploys on it and check that the good release is left as it was; sharing it (one group, one
    xdist worker: tests/conftest.py) saves a fleet and a first deploy with its start of SmolLM2.
    Each module puts it back first (`put_back`): it never depends on what the other left."""
    reason = fleet_available()
    if reason:
        pytest.skip(reason)
    f = Fleet(tmp_path_factory.mktemp("one-ct"), specs=(ONE,))
    try:
        f.start()
        res = f.ddtctl("deploy", ONE.name, "--no-smoke", "--json")
        host = json.loads(res.stdout)["hosts"][0] if res.stdout.startswith("{") else {}
        assert res.returncode == 0 and host.get("ok"), res.stderr[-3000:]
        f.good = host.get("current_release") or host["release"]
        yield f
    finally:
        f.close()


def link(f: Fleet, name: str) -> str:
    """The release the `name` link (current, previous) of ct330 points at."""
    return f.exec(ONE.name, "readlink", f"{ROOT}/{name}").stdout.strip().rsplit("/", 1)[-1]


def active(f: Fleet) -> bool:
    return f.show(ONE.name)["ActiveState"] == "active"


def put_back(f: Fleet) -> None:
    """ct330 active on its good release; restarted only when it is not (a start costs seconds)."""
    if link(f, "current") != f.good or not active(f):
        assert f.exec(ONE.name, "ln", "-sfn", f"releases/{f.good}", f"{ROOT}/current").returncode == 0
        f.exec(ONE.name, "systemctl", "reset-failed", f.specs[ONE.name].unit)
        assert f.exec(ONE.name, "systemctl", "restart", f.specs[ONE.name].unit).returncode == 0
