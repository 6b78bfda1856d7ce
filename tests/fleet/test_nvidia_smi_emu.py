"""Unit tests of the nvidia-smi emulation (tests/fleet/nvidia-smi): formats, sentinels, exit codes.

The expected strings are nvidia-smi's own (nvidia-smi(1)). The healthy outputs are
also fed to ddtctl's parser (ddtctl.ops.gpu) to check the two agree.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ddtctl.ops import gpu

NVSMI = Path(__file__).resolve().parent / "nvidia-smi"
FIELDS = "index,name,memory.total,memory.used,utilization.gpu,driver_version"


def nvsmi(tmp_path: Path, scenario: dict | None, *argv: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "DDT_EMU_ROOT": str(tmp_path)}
    if scenario is not None:
        path = tmp_path / "scenario.json"
        path.write_text(json.dumps(scenario))
        env["NVIDIA_SMI_EMU_SCENARIO"] = str(path)
    return subprocess.run([str(NVSMI), *argv], env=env, capture_output=True, text=True, timeout=30)


def test_healthy_h200_noheader_nounits_parses_with_ddtctl(tmp_path):
    res = nvsmi(tmp_path, {}, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits")
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout == "0, NVIDIA H200, 143771, 1024, 3, 570.133.20\n"
    rows = gpu.read_gpus(res.returncode, res.stdout, res.stderr)
    assert rows[0].name == "NVIDIA H200" and rows[0].memory_total_mib == 143771


def test_header_carries_units_and_values_keep_them_without_nounits(tmp_path):
    res = nvsmi(tmp_path, {"gpus": [{}, {"memory.used": 80000, "utilization.gpu": 97}]},
                "--query-gpu", "index,memory.used,utilization.gpu,power.draw,temperature.gpu",
                "--format", "csv")
    assert res.returncode == 0
    assert res.stdout.splitlines() == [
        "index, memory.used [MiB], utilization.gpu [%], power.draw [W], temperature.gpu",
        "0, 1024 MiB, 3 %, 75.23 W, 34",
        "1, 80000 MiB, 97 %, 75.23 W, 34",
    ]


def test_sentinels_pass_through_and_ddtctl_keeps_them_with_their_meaning(tmp_path):
    sc = {"gpus": [{"memory.used": "[Insufficient Permissions]", "utilization.gpu": "[N/A]",
                    "mig.mode.current": "Enabled"}]}
    res = nvsmi(tmp_path, sc, *gpu.QUERY_ARGV[1:])
    assert res.stdout == "0, NVIDIA H200, 143771, [Insufficient Permissions], [N/A], 570.133.20, Enabled\n"
    row = gpu.read_gpus(0, res.stdout)[0]
    assert (row.memory_used_mib, row.utilization_pct, row.memory_total_mib) == \
        ("[Insufficient Permissions]", "[N/A]", 143771)
    assert row.mig_mode == "Enabled" and "MIG mode" in row.notes()["[N/A]"]


def test_unknown_field_is_exit_2_with_nvidia_smi_message(tmp_path):
    res = nvsmi(tmp_path, {}, "--query-gpu=index,compute_capability", "--format=csv")
    assert res.returncode == 2
    assert res.stdout == 'Field "compute_capability" is not a valid field to query.\n\n'


@pytest.mark.parametrize("scenario,code,text", [
    ("driver_mismatch", 18, "Failed to initialize NVML: Driver/library version mismatch\n"
                            "NVML library version: 570.133\n"),
    ("no_devices", 6, "No devices were found\n"),
    ("no_driver", 9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                     "Make sure that the latest NVIDIA driver is installed and running.\n\n"),
    ("nvml_unknown", 255, "Failed to initialize NVML: Unknown Error\n"),
])
def test_failure_scenarios_exit_codes_and_strings(tmp_path, scenario, code, text):
    res = nvsmi(tmp_path, {"error": scenario}, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits")
    assert (res.returncode, res.stdout) == (code, text)
    assert gpu.read_gpus(res.returncode, res.stdout, res.stderr).exit_code == code


def test_missing_scenario_file_behaves_like_no_driver(tmp_path):
    res = nvsmi(tmp_path, None, "-L")
    assert res.returncode == 9 and "couldn't communicate with the NVIDIA driver" in res.stdout


def test_id_filter_list_version_and_unknown_option(tmp_path):
    sc = {"gpus": [{}, {"name": "NVIDIA H100 80GB HBM3"}]}
    res = nvsmi(tmp_path, sc, "-i", "1", "--query-gpu=index,name", "--format=csv,noheader")
    assert res.stdout == "1, NVIDIA H100 80GB HBM3\n"
    assert nvsmi(tmp_path, sc, "--id=7", "-L").returncode == 6
    listing = nvsmi(tmp_path, sc, "-L").stdout.splitlines()
    assert listing[0].startswith("GPU 0: NVIDIA H200 (UUID: GPU-") and len(listing) == 2
    assert "DRIVER version      : 570.133.20" in nvsmi(tmp_path, sc, "--version").stdout
    bad = nvsmi(tmp_path, sc, "--bogus")
    assert bad.returncode == 2 and "Option --bogus is not recognized" in bad.stdout


def test_compute_apps_and_summary_table(tmp_path):
    sc = {"processes": [{"pid": 4242, "process_name": "python3", "used_memory": 2048}]}
    res = nvsmi(tmp_path, sc, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader")
    assert res.stdout == "4242, python3, 2048 MiB\n"
    table = nvsmi(tmp_path, sc).stdout
    assert "Driver Version: 570.133.20" in table and "1024MiB / 143771MiB" in table
