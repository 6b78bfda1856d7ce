"""Start the REAL `ddtree-server serve` process on a free loopback port and wait for /ready.

Used by the API end-to-end tests (and usable by anyone else): the server runs as a subprocess
(`python -m ddtree_server serve ...`), its combined stdout/stderr goes to a log file that the
tests can read (`log_text()`), and `stop()` sends SIGTERM and returns the exit status.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CPU_ARGS = ("--device", "cpu", "--dtype", "fp32")
# One intra-op thread in the served process, as the in-process tests pin (tests/server/conftest.py):
# the test machines are small and shared, and OpenMP threads spin-waiting under oversubscription
# make SmolLM2's tiny forwards several times dearer in CPU seconds (a caller's env may override).
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# Settings of the shared session server (tests/server/api_fixtures.py).
API_KEY = "sk-test-ddtree"
MODEL = "smol-test"
MAX_MODEL_LEN = 1024


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One `ddtree-server serve` subprocess on 127.0.0.1.

    `args` are extra serve options (the CPU/fp32 defaults come first); `env` adds environment
    variables. `start()` raises RuntimeError with the log tail when the process exits or is not
    ready within `ready_timeout` seconds.
    """

    def __init__(self, *args: str, env: dict[str, str] | None = None, ready_timeout: float = 600.0) -> None:
        self.args, self.extra_env, self.ready_timeout = list(args), dict(env or {}), ready_timeout
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="ddtree-server-", suffix=".log")[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def start(self, wait: bool = True) -> "ServerProcess":
        """Launch (retrying on a port race) and, with `wait`, block until /ready is 200.

        Without `wait` it returns once the port listens or the process has exited."""
        for _attempt in range(3):
            self.port = free_port()
            argv = [sys.executable, "-m", "ddtree_server", "serve", *CPU_ARGS,
                    "--host", "127.0.0.1", "--port", str(self.port), *self.args]
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **THREAD_ENV, **self.extra_env}
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            if not self._wait_listening():
                if "address already in use" in self.log_text().lower():
                    continue
                if not wait:   # the caller expects (or inspects) an early exit
                    return self
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            break
        if wait:
            self.wait_ready(self.ready_timeout)
        return self

    def _wait_listening(self, timeout: float = 120.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return True
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"server did not listen within {timeout} s:\n{self.log_tail()}")

    def wait_ready(self, timeout: float) -> dict:
        """Poll /ready until 200; returns its JSON. Raises RuntimeError on exit or timeout."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                response = httpx.get(self.url("/ready"), timeout=5)
                last = response.json()
                if response.status_code == 200:
                    return last
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(0.25)
        raise RuntimeError(f"not ready after {timeout} s (last /ready: {last}):\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        """Send `sig` and wait for the exit status (SIGKILL after `timeout` seconds)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
