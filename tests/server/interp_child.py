"""One Triton-interpreter child process per test module, serving the module's parts on request.

The interpreter must be chosen (``TRITON_INTERPRET=1``) before triton is imported, so the kernel
tests run their checks in a child process. Importing torch and triton (and patching the
interpreter, ``interp_fast``) costs a child ~3-4 CPU-seconds: a module whose tests each started
their own child paid it per test. ``Child`` starts one child per module (a module-scoped fixture)
that defines the module's parts as functions (``PARTS``: name -> function returning a
JSON-serialisable report) and runs a part each time a test asks for it, so a test deselected with
``-k`` / ``-m`` costs nothing and each test keeps its own report and asserts. A part that raises
is reported as the test's failure (its traceback); the child keeps serving the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_MARK = "@@interp-child@@ "

_SERVE = r"""
import json as _json, sys as _sys, traceback as _tb
for _line in _sys.stdin:
    _name, _args = _json.loads(_line)
    try:
        _out = {"ok": PARTS[_name](*_args)}
    except BaseException:
        _out = {"error": _tb.format_exc()}
    _sys.stdout.write("\n" + MARK + _json.dumps(_out) + "\n")
    _sys.stdout.flush()
"""


class Child:
    """A child process running ``code`` (which defines ``PARTS``) under the Triton interpreter."""

    def __init__(self, code: str, **env: str):
        full = {**os.environ, "TRITON_INTERPRET": "1", **env,
                "PYTHONPATH": os.pathsep.join([str(ROOT / "server"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", f"MARK = {_MARK!r}\n{code}\n{_SERVE}"], env=full, cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)

    def __call__(self, name: str, *args) -> dict:
        """The report of part ``name`` (``args``: JSON-serialisable); AssertionError on its failure."""
        self.proc.stdin.write(json.dumps([name, list(args)]) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                out = json.loads(line[len(_MARK):])
                assert "error" not in out, out.get("error")
                return out["ok"]
        self.proc.wait()
        self.err.seek(0)
        raise AssertionError(f"child exited ({self.proc.returncode}): {self.err.read()[-4000:]}")

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


def module_child(code: str, skip_without: str | None = None, **env: str):
    """The module-scoped ``child`` fixture of a kernel test module: one ``Child(code, **env)`` for
    the module's tests, closed after them (``skip_without``: a module whose absence skips them).
    Assign it to the module's ``child`` name."""
    @pytest.fixture(scope="module")
    def child():
        if skip_without:
            pytest.importorskip(skip_without)
        c = Child(code, **env)
        yield c
        c.close()
    return child
