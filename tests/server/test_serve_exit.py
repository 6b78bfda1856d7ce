"""The served process leaves through commands/serve.py's `leave`: its exit status, its logs and
its standard streams flushed, and the interpreter not finalised (after a clean drain that only
tore down torch one object at a time, ~1.5 s of every restart)."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import atexit, logging, sys
from ddtree_server.commands.serve import leave
logging.basicConfig(level="INFO", stream=sys.stderr, format="%(message)s")
atexit.register(lambda: print("finalised", file=sys.stderr, flush=True))
logging.getLogger("x").info("exiting with status 3")
sys.stdout.write("buffered, no newline")
leave(3)
print("after leave", file=sys.stderr)
"""


def test_leave_flushes_then_exits_with_the_status_without_finalising():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newline"
    assert "exiting with status 3" in done.stderr
    assert "finalised" not in done.stderr and "after leave" not in done.stderr
