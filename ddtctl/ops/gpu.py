"""nvidia-smi: the query argv, CSV parsing and error classification (pure functions).

Source: nvidia-smi(1) (exit codes, `--query-gpu` fields, `--format=csv,noheader,nounits`).
Memory values are MiB, utilisation is percent. A bracketed token (`[N/A]`, `[Not Supported]`,
`[Insufficient Permissions]`, `[Unknown Error]`, ...) is nvidia-smi saying the value is
unavailable: it is kept as that string (never turned into a number, nor into nothing) and
explained by `meaning()`: `[N/A]` on a MIG-enabled GPU is a value reported per MIG instance only,
`[Insufficient Permissions]` a value NVML does not let an unprivileged container read.
"""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass

FIELDS = ("index", "name", "memory.total", "memory.used", "utilization.gpu", "driver_version",
          "mig.mode.current")
QUERY_ARGV = ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits"]
# drivers older than R450 know no MIG fields ("Field ... is not a valid field to query", exit 2)
LEGACY_QUERY_ARGV = ["nvidia-smi", f"--query-gpu={','.join(FIELDS[:-1])}", "--format=csv,noheader,nounits"]

# nvidia-smi(1) RETURN VALUE section (NVML codes 17/18 included as the tool reports them).
EXIT_CODES = {
    2: "invalid argument or query field",
    3: "operation not supported on this GPU",
    4: "insufficient permissions",
    6: "query unsuccessful (object not found)",
    8: "external power cables not attached",
    9: "NVIDIA driver not loaded",
    10: "kernel detected an interrupt issue with a GPU",
    12: "NVML shared library not found",
    13: "function not implemented by this driver",
    14: "infoROM corrupted",
    15: "GPU has fallen off the bus or become inaccessible",
    17: "blocked by the operating system (cgroups)",
    18: "RM/library version mismatch",
    127: "nvidia-smi not found",
    255: "other error or internal driver error",
}

# (substring in the output, short problem, hint). First match wins.
SIGNATURES = (
    ("Driver/library version mismatch", "driver/library version mismatch",
     "the user-space NVIDIA libraries differ from the loaded kernel module: reboot the node after a "
     "driver upgrade, or install container libraries matching the host driver"),
    ("couldn't communicate with the NVIDIA driver", "cannot communicate with the NVIDIA driver",
     "the kernel module is not loaded on the node or /dev/nvidia* is missing in the container: "
     "check `lsmod | grep nvidia` on the node and the container's device entries"),
    ("No devices were found", "no GPU visible",
     "no accessible GPU: /dev/nvidia0 missing in the container, denied by the device cgroup, or the GPU is lost"),
    ("Failed to initialize NVML: Unknown Error", "NVML unknown error",
     "usually a device-cgroup denial: check the container's lxc.cgroup2.devices.allow lines "
     "(the nvidia-uvm major can change after a driver update)"),
    ("GPU is lost", "GPU is lost", "the GPU fell off the bus (Xid 79): reset or reboot the node"),
    ("command not found", "nvidia-smi not found", "install the NVIDIA user-space tools in the container"),
    ("No such file or directory", "nvidia-smi not found", "install the NVIDIA user-space tools in the container"),
)


@dataclass(frozen=True)
class GpuInfo:
    """One GPU row. A number is an int, or nvidia-smi's bracketed token (str) when it reports the
    value unavailable, or None when the field was empty or not asked for. mig_mode: "Enabled" /
    "Disabled" (mig.mode.current), None when not reported."""

    index: int | None
    name: str | None
    memory_total_mib: int | str | None
    memory_used_mib: int | str | None
    utilization_pct: int | str | None
    driver_version: str | None
    mig_mode: str | None = None

    def unavailable(self) -> dict[str, str]:
        """{field: token} for the numbers nvidia-smi reported as unavailable."""
        return {k: v for k, v in (("memory_total_mib", self.memory_total_mib),
                                  ("memory_used_mib", self.memory_used_mib),
                                  ("utilization_pct", self.utilization_pct)) if isinstance(v, str)}

    def notes(self) -> dict[str, str]:
        """{token: what it means here} for each unavailable value."""
        return {tok: meaning(tok, self.mig_mode) for tok in dict.fromkeys(self.unavailable().values())}

    def labels(self) -> dict[str, str]:
        """{token: a few words for a table cell} for each unavailable value."""
        return {tok: short_meaning(tok, self.mig_mode) for tok in dict.fromkeys(self.unavailable().values())}

    def to_dict(self) -> dict:
        return {**asdict(self), "notes": self.notes(), "labels": self.labels()}


def meaning(token: str, mig_mode: str | None = None) -> str:
    """What an unavailable-value token of nvidia-smi means (nvidia-smi(1), NVML return codes)."""
    if token == "[N/A]":
        if mig_mode == "Enabled":
            return ("MIG mode: utilisation and memory are reported per MIG instance, not per GPU "
                    "(nvidia-smi mig -lgi)")
        return "not available for this GPU or field (e.g. in MIG mode)"
    if token == "[Insufficient Permissions]":
        return ("unprivileged container: NVML does not let it read this value (memory of MIG GPUs); "
                "read it on the node")
    if token == "[Not Supported]":
        return "not supported by this GPU or driver"
    if token == "[Unknown Error]":
        return "NVML unknown error (often a device-cgroup denial)"
    if token == "[GPU requires reset]":
        return "the GPU needs a reset (nvidia-smi -r on the node)"
    return "unavailable"


def short_meaning(token: str, mig_mode: str | None = None) -> str:
    """A few words for a table cell."""
    return {"[N/A]": "MIG mode" if mig_mode == "Enabled" else "not available",
            "[Insufficient Permissions]": "unprivileged container"}.get(token) or meaning(token, mig_mode)


@dataclass(frozen=True)
class GpuError:
    """A failed nvidia-smi call: what went wrong and what to do about it."""

    exit_code: int
    problem: str
    hint: str
    output: str

    def to_dict(self) -> dict:
        return asdict(self)


def _value(token: str) -> str | None:
    token = token.strip()
    return token or None


def _number(token: str) -> int | str | None:
    value = _value(token)
    if value is None or (value.startswith("[") and value.endswith("]")):
        return value
    try:
        return int(float(value))
    except ValueError:
        return None


def parse_gpus(text: str) -> list[GpuInfo]:
    """Parse `QUERY_ARGV` (or `LEGACY_QUERY_ARGV`) output: one CSV row per GPU, fields in `FIELDS`
    order. Raises ValueError naming the line when a row has the wrong number of fields."""
    rows = []
    for lineno, row in enumerate(csv.reader(io.StringIO(text), skipinitialspace=True), 1):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) not in (len(FIELDS), len(FIELDS) - 1):
            raise ValueError(f"nvidia-smi line {lineno}: expected {len(FIELDS)} fields, got {len(row)}: {row!r}")
        idx, name, total, used, util, driver, *mig = row
        mig_mode = _value(mig[0]) if mig else None
        index = _number(idx)
        rows.append(GpuInfo(index if isinstance(index, int) else None, _value(name), _number(total),
                            _number(used), _number(util), _value(driver),
                            None if mig_mode is None or mig_mode.startswith("[") else mig_mode))
    return rows


def classify_error(exit_code: int, output: str) -> GpuError:
    """Explain a failed nvidia-smi call from its exit code and output (stdout + stderr)."""
    for needle, problem, hint in SIGNATURES:
        if needle.lower() in output.lower():
            return GpuError(exit_code, problem, hint, output.strip())
    problem = EXIT_CODES.get(exit_code, f"nvidia-smi exited with {exit_code}")
    return GpuError(exit_code, problem, "run `nvidia-smi` on the host for details", output.strip())


def read_gpus(exit_code: int, stdout: str, stderr: str = "") -> list[GpuInfo] | GpuError:
    """The GPUs from one nvidia-smi run, or the classified error (also for unparseable output)."""
    if exit_code != 0:
        return classify_error(exit_code, f"{stdout}\n{stderr}")
    try:
        return parse_gpus(stdout)
    except ValueError as exc:
        err = classify_error(exit_code, stdout)
        if err.problem != f"nvidia-smi exited with {exit_code}":
            return err
        return GpuError(exit_code, "unexpected nvidia-smi output", str(exc), stdout.strip())


def select_gpus(gpus: list[GpuInfo], visible: list[str]) -> list[GpuInfo]:
    """The rows a service uses: `visible` holds CUDA_VISIBLE_DEVICES indices (all when empty)."""
    wanted = {int(v) for v in visible if v.strip().isdigit()}
    if not wanted:          # nothing selected, or MIG UUIDs that nvidia-smi rows cannot be matched to
        return gpus
    return [g for g in gpus if g.index in wanted]
