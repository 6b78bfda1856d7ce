"""Ctrl-C and broken pipes never skip a rollback or a lock release.

Real `python -m ddtctl` processes on the `local` host get a real SIGINT sent to their process group
(what a terminal does on Ctrl-C, reaching `tee` too when the output is piped) at chosen moments,
found from files the blocked step writes: a slow interpreter used for the release venv, a server
release that never becomes ready, an external-engine emulation that answers slowly
(tests/fleet/fake_engine). The wheel cache is seeded with a placeholder wheel, so no real wheel is
built: nothing in these tests gets as far as installing it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ddtctl.ops.bundle import source_identity

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
FAKE_ENGINE = REPO / "tests" / "fleet" / "fake_engine"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


class Local:
    """A `local` host `here` under a temp DDTCTL_HOME, with its inventory and a seeded wheel cache."""

    def __init__(self, tmp: Path, service: str):
        self.tmp, self.home, self.port = tmp, tmp / "home", _port()
        self.root = self.home / "hosts" / "here"
        self.vid = source_identity().version_id
        cache = self.home / "cache" / "wheels" / self.vid
        cache.mkdir(parents=True)
        (cache / "ddtree_server-0.0.0-py3-none-any.whl").write_bytes(b"placeholder")
        self.mark = tmp / "mark"
        inv = tmp / "inventory.yaml"
        inv.write_text(f"local:\n  here:\n    service: {{port: {self.port}, {service}}}\n")
        self.env = {**os.environ, "DDTCTL_INVENTORY": str(inv), "DDTCTL_HOME": str(self.home), "NO_COLOR": "1",
                    "DDT_MARK": str(self.mark)}

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "ddtctl", *args]

    def start(self, *args: str, **kw) -> subprocess.Popen:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        return subprocess.Popen(self.argv(*args), env=self.env, cwd=REPO, stdin=subprocess.DEVNULL, **kw)

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), env=self.env, cwd=REPO, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)

    def wait_for_mark(self, proc: subprocess.Popen, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while not (self.mark.exists() and self.mark.read_text()):
            assert proc.poll() is None, "ddtctl ended before reaching the step"
            assert time.monotonic() < deadline, "the step was not reached"
            time.sleep(0.05)
        return self.mark.read_text()

    def host(self):
        from ddtctl.inventory import load_inventory

        saved = os.environ.get("DDTCTL_HOME")
        os.environ["DDTCTL_HOME"] = str(self.home)
        try:
            return load_inventory(self.tmp / "inventory.yaml").hosts["here"]
        finally:
            os.environ.pop("DDTCTL_HOME") if saved is None else os.environ.__setitem__("DDTCTL_HOME", saved)

    @property
    def deployed(self) -> str:
        """The release folder a deploy of this checkout installs (build + dependency settings)."""
        from tests.ctl.release_stub import deployed_id
        return deployed_id(self.host(), self.vid)

    def release(self, vid: str, server: str) -> None:
        """An installed release that passes verification, whose console script runs `server` (a
        shell script body) for anything but `--version`."""
        from ddtctl.inventory import load_inventory
        from tests.ctl.release_stub import stub_release

        saved = os.environ.get("DDTCTL_HOME")
        os.environ["DDTCTL_HOME"] = str(self.home)
        try:
            host = load_inventory(self.tmp / "inventory.yaml").hosts["here"]
        finally:
            os.environ.pop("DDTCTL_HOME") if saved is None else os.environ.__setitem__("DDTCTL_HOME", saved)
        stub_release(host, vid, server)

    def link(self, name: str) -> str | None:
        try:
            return os.readlink(self.root / name).rsplit("/", 1)[-1]
        except OSError:
            return None

    def stop_service(self) -> None:
        subprocess.run(self.argv("stop", "here"), env=self.env, cwd=REPO, capture_output=True, timeout=60)


@pytest.fixture()
def good_and_hanging(tmp_path: Path):
    """current = release `good` (serves at once); this checkout's release is installed but its
    server never becomes ready (it writes the mark, then sleeps)."""
    local = Local(tmp_path, "kind: ddtree, ready_timeout_s: 5")
    local.release("0.0.0-good", f'shift\nexec {sys.executable} {FAKE_ENGINE} serve embedded "$@"\n')
    local.release(local.deployed, 'echo started > "$DDT_MARK"\nexec sleep 600\n')
    (local.root / "current").symlink_to("releases/0.0.0-good")
    yield local
    local.stop_service()


def _line(proc: subprocess.Popen, timeout: float = 30) -> bytes:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else b""


def _ready(local: Local) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{local.port}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_ctrl_c_during_venv_creation_exits_130_without_traceback(tmp_path: Path):
    slow = _script(tmp_path / "slow-python", f"#!{sys.executable}\nimport os, sys, time\n"
                   "open(os.environ['DDT_MARK'], 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    local = Local(tmp_path, f"kind: ddtree, python: {slow}")
    proc = local.start("deploy", "here", "--no-smoke", start_new_session=True)
    venv_pid = int(local.wait_for_mark(proc))
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    text = err.decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text and "interrupted" in text, text
    with pytest.raises(ProcessLookupError):
        os.kill(venv_pid, 0)                                   # the venv step was stopped
    assert not (local.root / "releases" / local.deployed).exists()  # the half-made release removed
    assert not (local.root / ".ddtctl.lock").exists() and local.link("current") is None


def _pipeline(local: Local, log: Path, *args: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    """`ddtctl ARGS 2>&1 | tee LOG` in one new process group (a terminal's foreground job)."""
    tee = subprocess.Popen(["tee", str(log)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                           process_group=0)
    ddt = local.start(*args, stdout=tee.stdin, stderr=subprocess.STDOUT, process_group=tee.pid)
    tee.stdin.close()
    return tee, ddt


def test_ctrl_c_with_output_piped_to_tee_still_rolls_back_and_releases_the_lock(good_and_hanging, tmp_path):
    local = good_and_hanging
    tee, ddt = _pipeline(local, tmp_path / "log", "deploy", "here", "--no-smoke")
    local.wait_for_mark(ddt)                                    # the new release started: wait-ready
    os.killpg(tee.pid, signal.SIGINT)                           # Ctrl-C: tee dies, ddtctl is told
    assert tee.wait(10) != 0
    assert ddt.wait(60) == 130
    assert local.link("current") == "0.0.0-good" and local.link("previous") is None
    assert not (local.root / ".ddtctl.lock").exists()
    assert _ready(local)                                        # the old release serves again
    assert "Traceback" not in (tmp_path / "log").read_text()


def test_a_reader_that_goes_away_never_skips_the_rollback(good_and_hanging, tmp_path):
    local = good_and_hanging
    tee, ddt = _pipeline(local, tmp_path / "log", "deploy", "here", "--no-smoke")
    local.wait_for_mark(ddt)
    tee.kill()                                                  # only the reader: EPIPE from now on
    assert ddt.wait(90) == 4                                    # the readiness timeout, still reported
    assert local.link("current") == "0.0.0-good" and not (local.root / ".ddtctl.lock").exists()
    assert _ready(local)


def test_ctrl_c_during_smoke_stops_the_checks(tmp_path: Path):
    local = Local(tmp_path, "kind: ddtree, model_id: fake")
    engine = subprocess.Popen([sys.executable, str(FAKE_ENGINE), "serve", "m", "--port", str(local.port),
                               "--served-model-name", "fake", "--delay", "1"], stdout=subprocess.PIPE)
    try:
        assert _line(engine).startswith(b"fake engine serving")
        proc = local.start("smoke", "here", "--json", start_new_session=True)
        assert _line(engine).startswith(b"GET /v1/models"), proc.communicate(timeout=30)   # check 1 runs
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        engine.kill()
    assert proc.returncode == 130, err.decode()
    assert time.monotonic() - t0 < 4                           # not all checks (each takes >= 1 s)
    (host,) = json.loads(out)["hosts"]
    assert host["interrupted"] and not host["ok"]
    assert host["checks"][-1]["detail"] == "not run: interrupted (Ctrl-C)"
    assert "Traceback" not in err.decode()
