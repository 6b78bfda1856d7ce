"""Session fixtures for the SSH/pct test fleet (tests/fleet/node.py).

Tests outside tests/fleet use them by importing the fixture functions into their module:
``from tests.fleet.conftest import pve1, make_node  # noqa: F401``. The nodes behind them are
process-wide (node.shared_node), so importing into several modules starts each sshd only once.

* ``make_node(name)`` -> a started FakeNode (one per name per session);
* ``pve1`` -> the node "pve1";
* ``pve1_transport`` -> an SshTransport to pve1 as root, one per test module (closed after it);
* ``fleet_client_key`` -> path of the client private key every node accepts;
* ``one_ct_fleet`` -> one container deployed once (tests/fleet/fleet_fixtures.py).
"""

from __future__ import annotations

import pytest

from tests.fleet.node import FakeNode, close_all, fleet_available, fleet_base, shared_node
# defined there, registered here: ONE fixture for every module of tests/fleet (a session fixture
# imported into two test modules would be two fixtures, built twice)
from tests.fleet.fleet_fixtures import one_ct_fleet  # noqa: E402, F401


@pytest.fixture(scope="session")
def make_node():
    reason = fleet_available()
    if reason:
        pytest.skip(reason)
    yield shared_node
    close_all()


@pytest.fixture(scope="session")
def pve1(make_node) -> FakeNode:
    return make_node("pve1")


@pytest.fixture(scope="session")
def fleet_client_key(make_node):
    return fleet_base() / "id_ed25519"


@pytest.fixture(scope="module")
def pve1_transport(pve1: FakeNode):
    transport = pve1.transport()
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def jump(tmp_path_factory, fleet_client_key):
    """A second real sshd on loopback (alias `jump`) that accepts the fleet's client key: the
    bastion of ProxyJump tests."""
    from pathlib import Path

    from tests.fleet.sshd import SshServer

    pub = Path(f"{fleet_client_key}.pub").read_text()
    with SshServer(tmp_path_factory.mktemp("jump"), alias="jump", client_pubkeys=[pub]) as srv:
        yield srv
