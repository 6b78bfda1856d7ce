"""How the suite is spread over pytest-xdist workers (`make test` / `make test-fast` run
`pytest -n N --dist loadgroup`).

Every test runs on the worker that runs the rest of its module, so module-scoped fixtures (a child
process that computes a module's results once, a jump host, an SSH transport) are built once, as
in a plain `pytest` run. Modules that share an expensive session fixture form one group, so that
fixture is built on one worker only. Without xdist (`pytest` alone, `-n 0`) the marks do nothing.
"""

from __future__ import annotations

import pytest

# session fixture -> group: the modules using it run on one worker, which builds it once
SHARED_SESSION_FIXTURES = {
    "api_server": "api-server",          # a real ddtree-server process with SmolLM2 (test_api_*.py)
}


@pytest.hookimpl(tryfirst=True)          # before xdist's own hook turns the marks into scopes
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        names = set(getattr(item, "fixturenames", ()))
        group = next((g for fixture, g in SHARED_SESSION_FIXTURES.items() if fixture in names), None)
        item.add_marker(pytest.mark.xdist_group(group or item.nodeid.split("::")[0]))
