"""How the suite is spread over pytest-xdist workers (`make test` / `make test-fast` run
`pytest -n N --dist loadgroup`).

A test that uses a module-scoped fixture (a child process computing a module's results once, a
jump host, an SSH transport) runs on the worker that runs the rest of its module, so that fixture
is built once, as in a plain `pytest` run. Modules that share an expensive session fixture form
one group, so it is built on one worker only. All other tests are spread one by one. Under
xdist the long tests (`slow`, `fleet`, `kernels`) are handed out first, so none of them starts
last while the other workers idle. Without xdist (`pytest` alone, `-n 0`) nothing changes.
"""

from __future__ import annotations

import pytest

# session fixture (defining module, name) -> group: the tests using it run on one worker, which
# builds it once. Keyed by where the fixture is defined, not by its name alone: a module may define
# its own fixture of the same name (test_router_fleet.py's module-scoped `fleet`), which is that
# module's own group, not the shared one.
SHARED_SESSION_FIXTURES = {
    ("tests.server.api_fixtures", "api_server"): "api-server",  # a real ddtree-server with SmolLM2 (test_api_*.py)
    ("tests.fleet.fleet_fixtures", "fleet"): "fleet",           # the 3-container test fleet (test_fleet_e2e.py)
}
MODULE_SCOPES = {"module", "package", "class"}
LONG_MARKERS = ("slow", "fleet", "kernels")


def _group(item) -> str | None:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    for chain in defs:                   # chain[-1]: the definition the test gets
        group = SHARED_SESSION_FIXTURES.get((getattr(chain[-1].func, "__module__", None), chain[-1].argname))
        if group:
            return group
    if any(d.scope in MODULE_SCOPES for chain in defs for d in chain):
        return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)          # before xdist's own hook turns the marks into scopes
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        group = _group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike (stable)
        items.sort(key=lambda item: not any(item.get_closest_marker(m) for m in LONG_MARKERS))
