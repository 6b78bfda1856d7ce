"""Session fixture of the 3-container test fleet (tests/fleet/fleet.py).

Use it by importing into a test module: ``from tests.fleet.fleet_fixtures import fleet  # noqa: F401``
(tests/fleet/conftest.py belongs to the node fixtures; this module keeps the fleet apart from it).
The nodes are the process-wide shared nodes of tests/fleet/node.py (closed at exit); the fixture
stops its containers (pct stop kills every process in them, services included) at session end.
"""

from __future__ import annotations

import pytest

from tests.fleet.fleet import Fleet
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
