"""Time `ddtctl status --all` over the wide test fleet (tests/fleet/scale.py: 4 nodes x 8 containers).

    python -m tests.fleet.scale_bench [--out docs/benchmarks] [--ddtctl-root DIR] [--label NAME]

Runs `status --all -p 4` and `-p 16` (GPUs queried) three times each with every service stopped,
then deploys all 32 engine emulations (`deploy --all -p 16 --no-smoke`) and again with 32 live
services; records per run the wall time, the SSH logins the nodes' sshd accepted, the CPU time of
the ddtctl process and the machine's load average (the remote side, sshd and the emulations, runs
on the same cores). Writes
`status-scale[-LABEL].json` and `.md` under --out. `--ddtctl-root` runs the ddtctl of another
checkout (e.g. an older commit, for a before/after comparison). Needs root, openssh-server and
util-linux (the test fleet's requirements).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.fleet.node import close_all
from tests.fleet.scale import REPO, ScaleFleet


def _status(fleet: ScaleFleet, root: Path, *args: str) -> dict:
    before = sum(fleet.logins().values())
    cpu0, load, t = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0], time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ddtctl", "status", "--all", *args], env=fleet.env(), cwd=root,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    seconds, cpu1 = time.monotonic() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
    time.sleep(0.5)                                              # sshd writes its log line late
    return {"seconds": round(seconds, 2), "exit_code": proc.returncode,
            "ssh_logins": sum(fleet.logins().values()) - before,
            "ddtctl_cpu_s": round(cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime, 2),
            "load_avg_1m": round(load, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks"))
    ap.add_argument("--ddtctl-root", default=str(REPO))
    ap.add_argument("--label", default="")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    root = Path(args.ddtctl_root).resolve()
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    rows, deploys = [], []
    with tempfile.TemporaryDirectory(prefix="ddt-scale-") as tmp:
        fleet = ScaleFleet(Path(tmp)).start()
        try:
            for phase in ("stopped", "live"):
                if phase == "live":
                    for attempt in (1, 2, 3):          # a failed host is recorded, then deployed again
                        dep = fleet.ddtctl("deploy", "--all", "-p", "16", "--no-smoke", timeout=1800)
                        failed = [ln for ln in dep.stderr.splitlines() if ln.startswith("error:")]
                        deploys.append({"attempt": attempt, "exit_code": dep.returncode, "errors": failed})
                        print(deploys[-1], flush=True)
                        if dep.returncode == 0:
                            break
                    else:
                        raise SystemExit(f"deploy failed ({dep.returncode}):\n{dep.stderr[-3000:]}")
                for _ in range(args.runs):
                    for par in ("4", "16"):
                        rows.append({"phase": phase, "parallel": int(par), **_status(fleet, root, "-p", par)})
                        print(rows[-1], flush=True)
        finally:
            fleet.stop_services()
            fleet.close()
            close_all()
    doc = {"command": "ddtctl status --all -p 4|16 (GPUs queried)", "containers": 32, "nodes": 4,
           "ddtctl_commit": commit, "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
           "runs": rows, "deploys": deploys,
           "median_s": {f"{p} -p {n}": statistics.median(r["seconds"] for r in rows if (r["phase"], r["parallel"]) == (p, n))
                        for p in ("stopped", "live") for n in (4, 16)}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "status-scale" + (f"-{args.label}" if args.label else "")
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [f"# `ddtctl status --all`: 32 containers on 4 nodes (ddtctl {commit})", "",
             f"{doc['machine']['cpus']} CPU cores; real sshd per node, pct/systemctl/nvidia-smi emulations "
             "(tests/fleet/scale.py); `python -m tests.fleet.scale_bench`.", "",
             "| services | -p | seconds | exit | SSH logins | ddtctl CPU s | load avg (1 min) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['phase']} | {r['parallel']} | {r['seconds']} | {r['exit_code']} | {r['ssh_logins']} | "
              f"{r['ddtctl_cpu_s']} | {r['load_avg_1m']} |" for r in rows]
    lines += ["", "Median seconds: " + ", ".join(f"{k}: {v}" for k, v in doc["median_s"].items()) + ".", "",
              "`deploy --all -p 16 --no-smoke` before the live runs (a failed attempt is repeated):", ""]
    lines += [f"* attempt {d['attempt']}: exit {d['exit_code']}" + (f", {len(d['errors'])} hosts failed: "
              f"`{d['errors'][0][:160]}`" if d["errors"] else "") for d in deploys]
    lines.append("")
    (out / f"{stem}.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
