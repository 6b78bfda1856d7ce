"""The phase-2 probe (bench/probe_phase2.py) runs its CPU-runnable parts end to end at the tiny shape:
stage tables and profiles with the kernel switch on and off, the exactness runs, the summary. On CPU
without TRITON_INTERPRET both settings take the SDPA path (the kernel path has its own tests); the
attention timing needs CUDA graphs and says so."""

from __future__ import annotations

import json
import os

from ddtree_server.bench import probe
from ddtree_server.kernels.runtime import ENV


def test_probe_phase2_runs_on_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc = probe.main(["--phase2", "--out", str(tmp_path), "--shapes", "tiny", "--context", "16", "--iters", "1",
                     "--budget-s", "100"])
    doc = json.loads((tmp_path / "probe2.json").read_text())
    assert rc == 0 and not doc["errors"], doc["errors"]
    assert set(doc["parts"]) == {"copy", "attention", "stages", "exact"}
    assert doc["parts"]["attention"] == {"skipped": "no CUDA"}
    for label in ("on", "off"):
        run = doc["parts"]["stages"]["tiny"][label]
        assert run["meta"]["kernels"] == label and run["stages"]["plain_step"]["ms"] > 0
        assert set(run["profile"]) == {"plain_step", "verify_ddtree_64", "draft"}
        assert (tmp_path / f"random-tiny-kernels-{label}.md").exists()
        assert doc["summary"][f"stages/tiny/{label}"]["plain_step"] > 0
    (exact,) = doc["parts"]["exact"]
    assert exact["all_equal_on"] and exact["ar_on_equals_ar_off"], exact
    assert set(exact["same_as_ar"]) == {f"{m}/{f}" for m in ("ar", "dflash", "ddtree-16", "ddtree-64") for f in ("on", "off")}
    assert doc["summary"]["exact"][0]["all_equal_on"] is True
    assert ENV not in os.environ  # the probe leaves the switch as it found it (unset)
