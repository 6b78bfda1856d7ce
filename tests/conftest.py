"""How the suite is spread over pytest-xdist workers (`make test` / `make test-fast` run
`pytest -n N --dist loadgroup`).

A test that uses a module-scoped fixture (a child process computing a module's results once, a
jump host, an SSH transport) runs on the worker that runs the rest of its module, so that fixture
is built once, as in a plain `pytest` run. Modules that share an expensive session fixture form
one group, so it is built on one worker only. All other tests are spread one by one.

Order: xdist hands out groups in the order the workers collected them (xdist's own reordering by
the number of tests per group is turned off: a group of 291 quick tests is not the longest). The
workers sort the groups (and ungrouped tests) longest first by their estimated seconds
(tests/xdist_costs.py: measured seconds of the slow ones, else an estimate by marker), so the
longest start first and the short ones fill in at the end. The tests of one group keep their
file order. Without xdist (`pytest` alone, `-n 0`) nothing changes.

Threads: every test process, and every server, ddtctl and container service it starts (they
inherit the environment; the systemd emulation's services get it as systemd's DefaultEnvironment=,
tests/fleet/emu/proc.py), runs torch on ONE thread (OMP_NUM_THREADS=1 unless set). Several of them
share the cores: with torch's default (a thread per core) their OpenMP threads spin-wait on each
other, and the same run of tests/server/test_api_batching.py beside other work took 150 s of CPU
instead of 55 s. The exact-equality tests compare runs made under the same setting.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")   # before anything imports torch (see above)
# ddtctl's wait-ready: at most 2 s between polls of a server still starting (default 10 s, which
# overshot a start of ~15 s by up to 10 s; ddtctl/ops/readiness.py)
os.environ.setdefault("DDTCTL_READY_POLL_MAX_S", "2")

import pytest  # noqa: E402

from tests.xdist_costs import estimate  # noqa: E402

# session fixture (defining module, name) -> group: the tests using it run on one worker, which
# builds it once. Keyed by where the fixture is defined, not by its name alone: a module may define
# its own fixture of the same name (test_router_fleet.py's module-scoped `fleet`), which is that
# module's own group, not the shared one.
SHARED_SESSION_FIXTURES = {
    ("tests.server.api_fixtures", "api_server"): "api-server",  # a real ddtree-server with SmolLM2 (test_api_*.py)
    ("tests.fleet.fleet_fixtures", "fleet"): "fleet",           # the 3-container test fleet (test_fleet_e2e.py)
    ("tests.fleet.fleet_fixtures", "one_ct_fleet"): "one-ct-fleet",  # test_immutable_releases.py + test_recovery.py
}
MODULE_SCOPES = {"module", "package", "class"}


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


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "loadgroup" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False   # our order (longest first), not xdist's by test count


def _group_of(item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


@pytest.hookimpl(tryfirst=True)          # before xdist's own hook turns the marks into scopes
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        group = _group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike (stable)
        seconds = {item.nodeid: estimate(item) for item in items}
        per_group: dict[str, float] = {}
        for item in items:
            group = _group_of(item)
            if group is not None:
                per_group[group] = per_group.get(group, 0.0) + seconds[item.nodeid]
        items.sort(key=lambda item: -per_group.get(_group_of(item), seconds[item.nodeid]))
