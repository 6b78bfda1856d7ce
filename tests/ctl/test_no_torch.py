"""Importing ddtctl (CLI and every op) never imports torch, transformers or the server package."""

from __future__ import annotations

import subprocess
import sys

MODULES = ["ddtctl", "ddtctl.cli.app", "ddtctl.inventory", "ddtctl.report", "ddtctl.ops.deploy",
           "ddtctl.ops.status", "ddtctl.ops.smoke", "ddtctl.ops.readiness", "ddtctl.ops.supervisor",
           "ddtctl.ops.units", "ddtctl.ops.gpu", "ddtctl.ops.weights", "ddtctl.ops.bundle", "ddtctl.ops.releases"]


def test_importing_ddtctl_does_not_import_torch() -> None:
    code = ("import importlib, sys\n"
            f"for m in {MODULES!r}: importlib.import_module(m)\n"
            "from ddtctl.cli.app import app\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'ddtree_server', 'numpy', 'gguf'))\n"
            "print(','.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"ddtctl imported {out.stdout.strip()}"


def test_help_does_not_import_torch() -> None:
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom ddtctl.cli.app import app\n"
            "r = CliRunner().invoke(app, ['deploy', '--help'])\nassert r.exit_code == 0, r.output\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
