"""Estimated seconds of each test, for the order in which pytest-xdist hands out the test groups
(tests/conftest.py: longest first).

MEASURED: seconds per test of the slowest ones, from full runs on 3 workers of a busy 2-core machine
(setup + call + teardown; a module fixture's cost spread over its module's tests), keyed by test
module or `module::function` (every parameter of the function alike). Others: by marker. Only the
order of the groups depends on these numbers: a stale entry can make the suite slower, never wrong.
Refresh them from the `--durations` table `make test` prints when the slowest tests change.
"""

from __future__ import annotations

MEASURED = {
    # the test fleet: real servers deployed over SSH into emulated containers
    "tests/fleet/test_fresh_container.py": 200.0,        # pip installs torch into two fresh venvs
    # these two share one container (group one-ct-fleet: tests/fleet/fleet_fixtures.py one_ct_fleet)
    "tests/fleet/test_immutable_releases.py": 70.0,      # 4 failed deploys, 3 restarts of SmolLM2 after them
    "tests/fleet/test_recovery.py": 35.0,                # each failed deploy stops and restarts SmolLM2
    "tests/fleet/test_fleet_e2e.py": 50.0,
    "tests/fleet/test_router_fleet.py": 50.0,
    "tests/ctl/test_push_many.py": 4.0,                  # a 9 MiB per-file push into a container
    "tests/ctl/test_push_many_faults.py": 6.0,           # own nodes for the peer faults
    # the Triton interpreter (test_kernels_engine: one child per test)
    "tests/server/test_kernels_engine.py::test_kernel_path_is_exact": 80.0,
    "tests/server/test_kernels_engine.py::test_target_kernel_path_equals_sdpa": 75.0,
    "tests/server/test_kernels_engine.py::test_drafter_kernel_path_equals_eager": 40.0,
    "tests/server/test_kernels_batch.py::test_engine_batched_on_the_kernel_path_equals_alone": 55.0,
    "tests/server/test_kernels_longctx.py::test_steps_and_chains_at_16k_32k_and_each_models_maximum": 100.0,
    "tests/server/test_kernels_longctx.py::test_hybrid_chains_take_the_kernel_and_match_sdpa": 70.0,
    "tests/server/test_kernels_longctx.py::test_a_block_longer_than_long_block_splits_little_and_matches": 45.0,
    "tests/server/test_kernels_longctx.py::test_lengths_around_every_tile_and_split_boundary": 40.0,
    # real servers and SmolLM2
    "tests/ctl/test_local_deploy.py::test_deploy_local_end_to_end": 280.0,
    "tests/server/test_api_longinput.py::test_a_long_prefill_is_progress_not_a_stall": 45.0,
    "tests/server/test_api_tool_grammar.py": 45.0,
    "tests/server/test_api_batching.py": 100.0,          # 64 concurrent streams, then 5 alone
    "tests/server/test_api_lifecycle.py::test_second_sigterm_exits_at_once_without_aborting": 100.0,
    "tests/server/test_api_lifecycle.py::test_drain_deadline_passed_exits_without_aborting": 80.0,
    "tests/server/test_api_lifecycle.py::test_model_load_failure_exits_1": 30.0,
    "tests/server/test_api_lifecycle.py::test_unusable_drafter_for_spec_mode_is_one_error_line": 30.0,
    "tests/server/test_api_longinput.py::test_real_server_caps_the_budget_and_reports_its_load": 35.0,
    "tests/server/test_hybrid_serve.py": 30.0,
    "tests/server/test_batch_soak.py": 95.0,            # thousands of requests through the batch engine (slot + paged)
    "tests/server/test_batch_trees.py::test_smollm2_shipped_drafter_device_trees_equal_alone_and_ar": 30.0,
    "tests/server/test_walk_gpu.py": 8.0,
    # SmolLM2 (and the interpreter) in module groups: their fixtures keep the module on one worker
    "tests/server/test_constrained_smollm2.py": 35.0,   # 4 tests of grammars / penalties x modes on SmolLM2
    "tests/server/test_chunked_prefill.py": 12.0,
    "tests/server/test_chunked_prefill.py::test_chunks_on_the_kernel_path_equal_whole": 110.0,
    "tests/server/test_solo_round.py": 5.0,
    "tests/server/test_solo_round.py::test_smollm2_device_round_equals_host_round": 25.0,
    "tests/server/test_default_drafter.py": 20.0,
    "tests/server/test_kernels_gdn_batch.py::test_hybrid_engine_batched_on_the_kernel_path_equals_alone": 95.0,
    "tests/server/test_kernels_gdn_batch.py::test_batched_tree_kernels_are_batch_invariant_and_match_torch": 60.0,
    "tests/server/test_kernels_gdn.py": 30.0,
    "tests/server/test_api_auth.py::test_empty_key_logs_that_authentication_is_off": 2.0,
    "tests/server/test_api_auth.py::test_a_key_logs_that_authentication_is_on_without_the_key": 2.0,
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
