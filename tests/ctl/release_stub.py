"""A release that passes verification without a real venv (for deploy tests that need an
installed release but no server): `venv/bin/ddtree-server` answers `--version` and fails to
serve; `venv/bin/python` is this interpreter (which has the server's dependencies); the manifest
is written by the real release_probe with the fingerprint deploy will expect for `host`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ddtctl.ops import packages, release_probe
from ddtctl.ops.release_step import venv_python
from ddtctl.ops.releases import Layout, release_id


def deployed_id(host, version_id: str) -> str:
    """The release folder a deploy of server build `version_id` looks for on `host` (its
    dependency settings hashed in: ops/releases.py `release_id`)."""
    return release_id(version_id, packages.install_plan(host, venv_python(host), "stub.whl").fingerprint)


def stub_release(host, version_id: str, server: str = 'echo "stub release: cannot serve" >&2\nexit 1\n') -> Path:
    """`server`: the shell body `ddtree-server` runs for anything but `--version`; `version_id`:
    the folder name (`deployed_id` for the one a deploy of this checkout uses)."""
    rel = Path(Layout(host.root, host.unit).release(version_id))
    (rel / "venv" / "bin").mkdir(parents=True, exist_ok=True)
    version = version_id.split("+", 1)[0].rsplit("-", 1)[0]
    script = rel / "venv" / "bin" / "ddtree-server"
    script.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "ddtree-server {version}"; exit 0; fi\n'
                      + server)
    script.chmod(0o755)
    if not (rel / "venv" / "bin" / "python").exists():
        os.symlink(sys.executable, rel / "venv" / "bin" / "python")
    python = venv_python(host)
    plan = packages.install_plan(host, python, str(rel / "stub.whl"))
    release_probe.write(str(rel), json.dumps({"version_id": version_id, "fingerprint": plan.fingerprint}))
    return rel
