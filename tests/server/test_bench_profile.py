"""bench.round_profile on the CPU: a tiny hybrid's DDTree steps on pages, profiled; the report
names the operators by time per step, and their time is within the step's wall time; with ``host``
the host functions too (the engine's step among them)."""

from __future__ import annotations

import json

from ddtree_server.bench import round_profile


def test_round_profile_of_a_tiny_hybrid_on_pages(tmp_path):
    doc = round_profile.profile("tiny-hybrid", 2, "ddtree", "paged", context=48, steps=2, warmup=1, device="cpu",
                                dtype="fp32", top=5, host=True)
    assert doc["kv_layout"] == "paged" and doc["batch"] == 2 and doc["step_ms"] > 0
    assert len(doc["kernels"]) == 5 and doc["kernel_kinds"] > 5
    times = [k["ms_per_step"] for k in doc["kernels"]]
    assert times == sorted(times, reverse=True) and 0 < times[0] <= doc["kernel_ms_per_step"]
    funcs = doc["host_functions"]
    assert len(funcs) == 5 and all(f["calls_per_step"] > 0 for f in funcs)
    own = [f["own_ms_per_step"] for f in funcs]
    assert own == sorted(own, reverse=True) and all(f["cumulative_ms_per_step"] >= f["own_ms_per_step"] for f in funcs)
    paths = round_profile.write(doc, tmp_path)
    md = paths["md"].read_text()
    assert json.loads(paths["json"].read_text())["mode"] == "ddtree" and "| kernel |" in md and "| function |" in md
