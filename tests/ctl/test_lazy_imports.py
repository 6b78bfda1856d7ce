"""Every ddtctl process starts cheap: a command imports what it uses when it runs.

The command modules keep their signatures (Typer needs every option and help text at
registration) and import the ops/remote stack in their bodies, so `--version` and `--help`
(of ddtctl and of a command) load none of it; below the CLI, SSH (paramiko), unit templates
(jinja2) and the Prometheus parser come with the first use that needs them, so a local host's
`status` or `render` never loads them. One child process checks all of it (a fresh sys.modules).
"""

from __future__ import annotations

import json
import subprocess
import sys

# what a command that only parses its arguments (--version, --help) must not load
STACK = ("paramiko", "cryptography", "httpx", "jinja2", "rich", "yaml", "prometheus_client",
         "ddtctl.inventory", "ddtctl.ops", "ddtctl.remote.ssh", "ddtctl.report")

CHILD = f"""
import contextlib, io, json, sys
from ddtctl.cli.app import main

STACK = {STACK!r}

def loaded():
    return sorted(m for m in sys.modules if any(m == s or m.startswith(s + ".") for s in STACK))

for argv, expect in ((["--version"], "ddtctl "), (["--help"], "deploy"), (["deploy", "--help"], "--rollback-timeout"),
                     (["status", "--help"], "--gpu")):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(argv)
    assert expect in out.getvalue(), (argv, out.getvalue())
    print(json.dumps([" ".join(argv), loaded()]))

# below the CLI: what a local host's status/render imports, without SSH, templates or metrics parsing
import ddtctl.ops.status, ddtctl.ops.units, ddtctl.remote.transport  # noqa: E401
print(json.dumps(["ops", [m for m in ("paramiko", "jinja2", "prometheus_client") if m in sys.modules]]))
"""


def test_help_and_version_import_no_stack_and_local_ops_no_ssh() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = dict(json.loads(line) for line in out.stdout.splitlines())
    assert loaded == {"--version": [], "--help": [], "deploy --help": [], "status --help": [], "ops": []}, loaded
