"""Estimated seconds of each test, for the order in which pytest-xdist hands out the test groups
(tests/conftest.py: longest first).

MEASURED: seconds per test of the slowest ones, from a full `make test` (3 workers on a 2-core
machine; setup + call + teardown, a module fixture's cost spread over its tests), keyed by test
module or `module::function` (every parameter of the function alike). Others: by marker. Only the
order of the groups depends on these numbers: a stale entry can make the suite slower, never wrong.
Refresh them from the `--durations` table `make test` prints when the slowest tests change.
"""

from __future__ import annotations

MEASURED = {
    # the test fleet: real servers deployed over SSH into emulated containers
    "tests/fleet/test_fresh_container.py": 250.0,        # pip installs torch into two fresh venvs
    "tests/fleet/test_immutable_releases.py": 105.0,     # 4 failed deploys + restarts of SmolLM2
    "tests/fleet/test_fleet_e2e.py": 50.0,
    "tests/fleet/test_router_fleet.py": 50.0,
    "tests/fleet/test_recovery.py": 50.0,
    # the Triton interpreter
    "tests/server/test_kernels_engine.py::test_target_kernel_path_equals_sdpa": 75.0,
    "tests/server/test_kernels_engine.py::test_kernel_path_is_exact": 80.0,
    "tests/server/test_kernels_engine.py::test_drafter_kernel_path_equals_eager": 40.0,
    # real servers and SmolLM2
    "tests/server/test_api_tool_grammar.py": 120.0,
    "tests/server/test_api_lifecycle.py": 45.0,
    "tests/server/test_hybrid_serve.py": 30.0,
}
BY_MARKER = (("kernels", 20.0), ("slow", 5.0), ("fleet", 2.0))
DEFAULT = 0.3


def estimate(item) -> float:
    """Estimated seconds of a collected test item."""
    path, _, rest = item.nodeid.split("@")[0].partition("::")
    for key in (f"{path}::{rest.split('[')[0]}", path):
        if key in MEASURED:
            return MEASURED[key]
    for marker, seconds in BY_MARKER:
        if item.get_closest_marker(marker):
            return seconds
    return DEFAULT
