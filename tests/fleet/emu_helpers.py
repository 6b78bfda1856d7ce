"""Helpers for the emulation unit tests: a fake root, the tools run as subprocesses, a test service.

`svc.py` is the service under test: it prints one JSON line (argv, environment, cwd), then acts on
its `key=value` arguments: `ready=S` (sd_notify READY=1 + STATUS=serving after S seconds),
`exit=N` (exit with N after `delay=S`), `ignore_term=1` (SIGTERM ignored), `child=1` (leaves a
`sleep` child in its session), else sleeps.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

FLEET = Path(__file__).resolve().parent
PY = "/usr/bin/python3"

SVC = r'''
import json, os, signal, socket, subprocess, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a and not a.startswith("-"))
print(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}), flush=True)
if args.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if args.get("child"):
    p = subprocess.Popen(["/bin/sleep", "1000"])
    print(f"child={p.pid}", flush=True)
if "exit" in args:
    time.sleep(float(args.get("delay", 0)))
    print("exiting", args["exit"], file=sys.stderr, flush=True)
    sys.exit(int(args["exit"]))
if "ready" in args:
    time.sleep(float(args["ready"]))
    addr = os.environ["NOTIFY_SOCKET"]
    addr = "\0" + addr[1:] if addr.startswith("@") else addr
    socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"READY=1\nSTATUS=serving", addr)
time.sleep(1000)
'''


class Emu:
    def __init__(self, root: Path):
        self.root = root
        self.unit_dir = root / "etc/systemd/system"
        self.unit_dir.mkdir(parents=True, exist_ok=True)
        self.svc = root / "svc.py"
        self.svc.write_text(SVC)

    def env(self) -> dict:
        return {"PATH": os.environ["PATH"], "DDT_EMU_ROOT": str(self.root), "DDT_LEAK": "caller-env"}

    def unit(self, name: str, body: str) -> Path:
        path = self.unit_dir / name
        path.write_text(body.replace("@SVC@", f"{PY} {self.svc}"))
        return path

    def run(self, tool: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(FLEET / tool), *argv], env=self.env(), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def ctl(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.run("systemctl", *argv, timeout=timeout)

    def journal(self, unit: str, *argv: str) -> list[str]:
        return self.run("journalctl", "-u", unit, "--no-pager", "-o", "cat", *argv).stdout.splitlines()

    def show(self, unit: str) -> dict:
        out = self.ctl("show", unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def first_json(self, unit: str) -> dict:
        return next(json.loads(line) for line in self.journal(unit) if line.startswith("{"))


def alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"
