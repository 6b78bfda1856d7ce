"""nvidia-smi emulation driven by a JSON scenario file (no GPUs here).

Emulates nvidia-smi(1) output formats and RETURN VALUE codes:
* `--query-gpu=f1,f2,... --format=csv[,noheader][,nounits]`: one `, `-joined row per GPU; the
  header names the canonical field with its unit in brackets (`memory.total [MiB]`); `nounits`
  drops the value units (` MiB`, ` %`, ` W`, ` MHz`); bracketed sentinels such as `[N/A]` and
  `[Not Supported]` are printed as they are. An unknown field prints
  `Field "x" is not a valid field to query.` plus a blank line and exits 2 (invalid argument).
* `--query-compute-apps=pid,process_name,used_memory,...`, `-i/--id=` (index, UUID or bus id;
  none matching -> "No devices were found", exit 6), `-L/--list-gpus`, `--version`,
  `--help-query-gpu`, and the default summary table.
* Failure scenarios print nvidia-smi's own messages on stdout with its exit codes:
  driver_mismatch (18, NVML_ERROR_LIB_RM_VERSION_MISMATCH), no_devices (6), no_driver (9),
  nvml_unknown (255), gpu_lost (15), no_permission (4). An unknown option exits 2.
Scenario: `$NVIDIA_SMI_EMU_SCENARIO`, else /var/log/ddt-emu/nvidia-smi.json under the emu root;
a missing file behaves like a node without a loaded driver (exit 9). Schema, all keys optional:
`{"error": null|"<scenario>", "driver_version": "570.133.20", "cuda_version": "12.8",
  "gpus": [{"<field>": value, ...}], "processes": [{"pid": 1, "process_name": "python3",
  "used_memory": 1000}]}` -- each GPU starts from an H200 template (see H200).
"""

from __future__ import annotations

import json
import os
import sys
import time

from .paths import Paths

ERRORS = {
    "driver_mismatch": (18, "Failed to initialize NVML: Driver/library version mismatch\n"
                            "NVML library version: {nvml}\n"),
    "no_devices": (6, "No devices were found\n"),
    "no_driver": (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                     "Make sure that the latest NVIDIA driver is installed and running.\n\n"),
    "nvml_unknown": (255, "Failed to initialize NVML: Unknown Error\n"),
    "gpu_lost": (15, "Unable to determine the device handle for GPU0000:18:00.0: GPU is lost.  "
                     "Reboot the system to recover this GPU\n"),
    "no_permission": (4, "Failed to initialize NVML: Insufficient Permissions\n"),
}
H200 = {
    "name": "NVIDIA H200", "serial": "1654324000001", "vbios_version": "96.00.A5.00.01",
    "memory.total": 143771, "memory.used": 1024, "memory.reserved": 604, "utilization.gpu": 3,
    "utilization.memory": 0, "temperature.gpu": 34, "temperature.memory": 41, "power.draw": 75.23,
    "power.limit": 700.0, "enforced.power.limit": 700.0, "clocks.sm": 1980, "clocks.mem": 3201,
    "clocks.max.sm": 1980, "fan.speed": "[N/A]", "pstate": "P0", "persistence_mode": "Enabled",
    "compute_mode": "Default", "mig.mode.current": "Disabled", "mig.mode.pending": "Disabled",
    "compute_cap": "9.0", "display_mode": "Disabled", "display_active": "Disabled",
    "ecc.errors.uncorrected.volatile.total": 0,
}
UNITS = {"memory.total": "MiB", "memory.used": "MiB", "memory.free": "MiB", "memory.reserved": "MiB",
         "utilization.gpu": "%", "utilization.memory": "%", "fan.speed": "%", "power.draw": "W",
         "power.limit": "W", "enforced.power.limit": "W", "clocks.sm": "MHz", "clocks.mem": "MHz",
         "clocks.max.sm": "MHz"}
ALIASES = {"gpu_name": "name", "gpu_serial": "serial", "gpu_uuid": "uuid", "gpu_bus_id": "pci.bus_id",
           "clocks.current.sm": "clocks.sm", "clocks.current.memory": "clocks.mem",
           "power.draw.instant": "power.draw", "temperature.gpu.tlimit": "temperature.gpu"}
GPU_FIELDS = ["timestamp", "driver_version", "count", "index", "uuid", "pci.bus_id", "memory.free",
              *H200]
APP_FIELDS = {"pid", "process_name", "used_memory", "used_gpu_memory", "gpu_uuid", "gpu_bus_id", "gpu_name"}


class Fail(Exception):
    def __init__(self, code: int, text: str):
        super().__init__(text)
        self.code, self.text = code, text


def load_scenario() -> dict | None:
    path = os.environ.get("NVIDIA_SMI_EMU_SCENARIO") or str(Paths.from_env().nvidia_scenario)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def gpus_of(sc: dict) -> list[dict]:
    out = []
    for i, over in enumerate(sc.get("gpus", [{}])):
        g = {**H200, "index": i, "uuid": f"GPU-{0x5a1e0000 + i:08x}-8f3c-4b7d-9e21-{0x1d2c3b4a5f60 + i:012x}",
             "pci.bus_id": f"00000000:{0x18 + 0x20 * i:02X}:00.0", **over}
        if isinstance(g["memory.total"], int) and isinstance(g["memory.used"], int):
            g.setdefault("memory.free", g["memory.total"] - g["memory.used"] - g.get("memory.reserved", 0))
        g.setdefault("memory.free", "[N/A]")
        out.append(g)
    return out


def _fmt(field: str, value, units: bool) -> str:
    if isinstance(value, str) and value.startswith("["):
        return value
    if isinstance(value, float):
        value = f"{value:.2f}"
    unit = UNITS.get(field)
    return f"{value} {unit}" if unit and units else str(value)


def _format_opts(fmt: str | None) -> tuple[bool, bool]:
    if fmt is None:
        raise Fail(2, 'Option "--format" must be given together with a --query-* option.\n')
    toks = [t.strip() for t in fmt.split(",") if t.strip()]
    if "csv" not in toks or any(t not in ("csv", "noheader", "nounits") for t in toks):
        raise Fail(2, f'"{fmt}" is not a valid format.\n')
    return "noheader" not in toks, "nounits" not in toks


def query_gpu(sc: dict, gpus: list[dict], fields: list[str], fmt: str | None) -> str:
    header, units = _format_opts(fmt)
    canon = []
    for f in fields:
        c = ALIASES.get(f, f)
        if c not in GPU_FIELDS:
            raise Fail(2, f'Field "{f}" is not a valid field to query.\n\n')
        canon.append(c)
    rows = []
    if header:
        rows.append(", ".join(f"{c} [{UNITS[c]}]" if c in UNITS else c for c in canon))
    now = time.strftime("%Y/%m/%d %H:%M:%S") + ".%03d" % (time.time() % 1 * 1000)
    for g in gpus:
        extra = {"timestamp": now, "driver_version": sc.get("driver_version", "570.133.20"),
                 "count": len(gpus)}
        rows.append(", ".join(_fmt(c, extra[c] if c in extra else g[c], units) for c in canon))
    return "".join(r + "\n" for r in rows)


def query_apps(sc: dict, gpus: list[dict], fields: list[str], fmt: str | None) -> str:
    header, units = _format_opts(fmt)
    for f in fields:
        if f not in APP_FIELDS:
            raise Fail(2, f'Field "{f}" is not a valid field to query.\n\n')
    rows = [", ".join(f"{f} [MiB]" if f.startswith("used_") else f for f in fields)] if header else []
    by_uuid = {g["uuid"]: g for g in gpus}
    for p in sc.get("processes", []):
        g = by_uuid.get(p.get("gpu_uuid"), gpus[0])
        vals = {"gpu_uuid": g["uuid"], "gpu_bus_id": g["pci.bus_id"], "gpu_name": g["name"], **p}
        vals["used_gpu_memory"] = vals.get("used_memory", "[N/A]")
        rows.append(", ".join(
            f"{vals.get(f, '[N/A]')} MiB" if f.startswith("used_") and units and not str(vals.get(f, "[")).startswith("[")
            else str(vals.get(f, "[N/A]")) for f in fields))
    return "".join(r + "\n" for r in rows)


def summary(sc: dict, gpus: list[dict]) -> str:
    drv, cuda = sc.get("driver_version", "570.133.20"), sc.get("cuda_version", "12.8")
    bar = "+-----------------------------------------+------------------------+----------------------+"
    out = [time.strftime("%a %b %d %H:%M:%S %Y"),
           "+" + "-" * 89 + "+",
           f"| NVIDIA-SMI {drv:<22} Driver Version: {drv:<14} CUDA Version: {cuda:<9}|",
           bar.replace("+", "|", 1),
           "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
           "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
           "|                                         |                        |               MIG M. |",
           bar.replace("-", "=")]
    for g in gpus:
        pm = "On" if g["persistence_mode"] == "Enabled" else "Off"
        fan = "N/A" if str(g["fan.speed"]).startswith("[") else f"{g['fan.speed']}%"
        pwr = f"{_fmt('power.draw', g['power.draw'], False).split('.')[0]}W / {int(g['power.limit'])}W"
        mem = f"{g['memory.used']}MiB / {g['memory.total']}MiB"
        out += [f"| {g['index']:>3}  {g['name']:<28}{pm:>5}  |   {g['pci.bus_id']} Off |"
                f"{g['ecc.errors.uncorrected.volatile.total']:>21} |",
                f"| {fan:<4} {g['temperature.gpu']:>3}C    {g['pstate']:<3} {pwr:>22} | {mem:>22} |"
                f" {str(g['utilization.gpu']) + '%':>8} {g['compute_mode']:>11} |",
                f"|{'':41}|{'':24}|{g['mig.mode.current']:>21} |", bar]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    try:
        sys.stdout.write(run(argv))
        return 0
    except Fail as exc:
        sys.stdout.write(exc.text)
        return exc.code


def run(argv: list[str]) -> str:
    opts: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        i += 1
        key, eq, value = a.partition("=")
        if key in ("--query-gpu", "--query-compute-apps", "--format", "-i", "--id"):
            if not eq:
                if i >= len(argv):
                    raise Fail(2, f"ERROR: Option {a} requires a value. Please run 'nvidia-smi -h'.\n")
                value, i = argv[i], i + 1
            opts["--id" if key == "-i" else key] = value
        elif a in ("-L", "--list-gpus", "--version", "--help-query-gpu", "-h", "--help"):
            opts[a] = None
        else:
            raise Fail(2, f"ERROR: Option {a} is not recognized. Please run 'nvidia-smi -h'.\n")
    if "--help-query-gpu" in opts or "-h" in opts or "--help" in opts:
        return 'List of valid properties to query for the switch "--query-gpu=":\n\n' + \
            "".join(f'"{f}"\n' for f in GPU_FIELDS)
    sc = load_scenario()
    if sc is None:
        sc = {"error": "no_driver"}
    if sc.get("error"):
        code, text = ERRORS[sc["error"]]
        raise Fail(code, text.format(nvml=".".join(sc.get("driver_version", "570.133.20").split(".")[:2])))
    gpus = gpus_of(sc)
    if opts.get("--id") is not None:
        ids = opts["--id"].split(",")
        gpus = [g for g in gpus if str(g["index"]) in ids or g["uuid"] in ids or g["pci.bus_id"] in ids]
    if not gpus:
        raise Fail(6, "No devices were found\n")
    if "--version" in opts:
        drv = sc.get("driver_version", "570.133.20")
        return (f"NVIDIA-SMI version  : {drv}\nNVML version        : {'.'.join(drv.split('.')[:2])}\n"
                f"DRIVER version      : {drv}\nCUDA Version        : {sc.get('cuda_version', '12.8')}\n")
    if "-L" in opts or "--list-gpus" in opts:
        return "".join(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})\n" for g in gpus)
    if "--query-gpu" in opts:
        return query_gpu(sc, gpus, opts["--query-gpu"].split(","), opts.get("--format"))
    if "--query-compute-apps" in opts:
        return query_apps(sc, gpus, opts["--query-compute-apps"].split(","), opts.get("--format"))
    return summary(sc, gpus)
