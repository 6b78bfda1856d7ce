"""nvidia-smi parsing and error classification on real-format samples (nvidia-smi(1))."""

from __future__ import annotations

import pytest

from ddtctl.ops.gpu import (LEGACY_QUERY_ARGV, QUERY_ARGV, GpuError, GpuInfo, classify_error, meaning, parse_gpus,
                            read_gpus, select_gpus, short_meaning)

# `nvidia-smi --query-gpu=index,name,memory.total,memory.used,utilization.gpu,driver_version
#  --format=csv,noheader,nounits` (no mig.mode.current: LEGACY_QUERY_ARGV) on an 8-GPU H200 box and
# on a Pro 6000 workstation.
H200 = """0, NVIDIA H200, 143771, 1, 0, 570.124.06
1, NVIDIA H200, 143771, 80211, 97, 570.124.06
"""
PRO6000 = "0, NVIDIA RTX PRO 6000 Blackwell Workstation Edition, 97887, 91234, 63, 575.57.08\n"
# MIG-enabled A100 inside an unprivileged container: utilisation [N/A], memory not readable.
MIG = "0, NVIDIA A100-SXM4-80GB, [Insufficient Permissions], [Insufficient Permissions], [N/A], 535.104.05, Enabled\n"


def test_query_argv_is_fixed() -> None:
    assert QUERY_ARGV == ["nvidia-smi",
                          "--query-gpu=index,name,memory.total,memory.used,utilization.gpu,driver_version,"
                          "mig.mode.current", "--format=csv,noheader,nounits"]
    assert LEGACY_QUERY_ARGV[1] == "--query-gpu=index,name,memory.total,memory.used,utilization.gpu,driver_version"


def test_parse_h200() -> None:
    gpus = parse_gpus(H200)
    assert gpus == [GpuInfo(0, "NVIDIA H200", 143771, 1, 0, "570.124.06"),
                    GpuInfo(1, "NVIDIA H200", 143771, 80211, 97, "570.124.06")]


def test_parse_name_with_spaces() -> None:
    (gpu,) = parse_gpus(PRO6000)
    assert gpu.name == "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
    assert (gpu.memory_total_mib, gpu.memory_used_mib, gpu.utilization_pct) == (97887, 91234, 63)


@pytest.mark.parametrize("token", ["[N/A]", "[Not Supported]", "[Insufficient Permissions]",
                                   "[Unknown Error]", "[GPU requires reset]"])
def test_bracketed_values_are_kept_as_nvidia_smi_printed_them(token: str) -> None:
    (gpu,) = parse_gpus(f"0, NVIDIA L4, {token}, {token}, {token}, 550.54.15, Disabled\n")
    assert (gpu.memory_total_mib, gpu.memory_used_mib, gpu.utilization_pct) == (token, token, token)
    assert gpu.driver_version == "550.54.15" and gpu.mig_mode == "Disabled"
    assert gpu.unavailable() == {"memory_total_mib": token, "memory_used_mib": token, "utilization_pct": token}
    assert list(gpu.notes()) == [token] and gpu.notes()[token] == meaning(token, "Disabled")
    assert gpu.to_dict()["memory_used_mib"] == token and gpu.to_dict()["notes"] == gpu.notes()


def test_mig_row_in_an_unprivileged_container_says_what_the_tokens_mean() -> None:
    (gpu,) = parse_gpus(MIG)
    assert gpu.index == 0 and gpu.mig_mode == "Enabled"
    assert (gpu.memory_used_mib, gpu.utilization_pct) == ("[Insufficient Permissions]", "[N/A]")
    notes = gpu.notes()
    assert notes["[N/A]"].startswith("MIG mode") and notes["[Insufficient Permissions]"].startswith("unprivileged")
    assert short_meaning("[N/A]", "Enabled") == "MIG mode"
    assert short_meaning("[Insufficient Permissions]") == "unprivileged container"


def test_blank_lines_ignored_and_bad_rows_rejected() -> None:
    assert parse_gpus("\n\n") == []
    with pytest.raises(ValueError, match="line 1: expected 7 fields"):
        parse_gpus("0, NVIDIA H200, 143771\n")


@pytest.mark.parametrize(("code", "output", "problem", "hint_word"), [
    (18, "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 570.133\n",
     "driver/library version mismatch", "reboot"),
    (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
        "latest NVIDIA driver is installed and running.\n", "cannot communicate with the NVIDIA driver", "lsmod"),
    (6, "No devices were found\n", "no GPU visible", "cgroup"),
    (255, "Failed to initialize NVML: Unknown Error\n", "NVML unknown error", "devices.allow"),
    (15, "Unable to determine the device handle for GPU0000:41:00.0: GPU is lost.  Reboot the system to "
         "recover this GPU\n", "GPU is lost", "reboot"),
    (127, "bash: nvidia-smi: command not found\n", "nvidia-smi not found", "install"),
    (4, "", "insufficient permissions", "nvidia-smi"),
    (77, "weird\n", "nvidia-smi exited with 77", "nvidia-smi"),
])
def test_classify(code: int, output: str, problem: str, hint_word: str) -> None:
    err = classify_error(code, output)
    assert err.problem == problem and err.exit_code == code
    assert hint_word in err.hint


def test_read_gpus_ok_and_error() -> None:
    assert read_gpus(0, H200)[1].utilization_pct == 97
    err = read_gpus(6, "No devices were found\n")
    assert isinstance(err, GpuError) and err.problem == "no GPU visible"
    # exit 0 but an error text instead of CSV (seen in the field): classified, not a crash
    err = read_gpus(0, "Failed to initialize NVML: Driver/library version mismatch\n")
    assert isinstance(err, GpuError) and err.problem == "driver/library version mismatch"


def test_select_gpus() -> None:
    gpus = parse_gpus(H200)
    assert [g.index for g in select_gpus(gpus, ["1"])] == [1]
    assert select_gpus(gpus, []) == gpus
    assert select_gpus(gpus, ["MIG-4f9a1c2e-0000-0000-0000-000000000000"]) == gpus
