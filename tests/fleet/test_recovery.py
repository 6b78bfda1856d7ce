"""Never leave a service down, on the test fleet over real SSH.

One container (ct330 on its own node, shared with test_immutable_releases.py:
tests/fleet/fleet_fixtures.py) runs the real ddtree-server under the systemd emulation,
which applies systemd 252's start rate limit (tests/fleet/emu/ratelimit.py; ddtctl's units:
StartLimitIntervalSec=600, StartLimitBurst=5). Faults, by class:
* a release that cannot start (a real build of this checkout whose `serve` exits at once),
  deployed three times in a row: each deploy is rolled back and the service ends active, though
  the deploys' and rollbacks' starts add up to more than the start limit allows;
* a unit left refused by its start limit (six starts in a row by hand): `ddtctl start` and
  `ddtctl deploy` bring it back;
* a short `deploy --timeout` (the last of those three deploys): the rollback waits under its own
  deadline;
* a previous release that fails too (a fake release whose server exits 1): `ddtctl rollback`
  restores the links and the running release; a deploy's automatic rollback reports the state
  the service is in. Every test starts with ct330 active on the good release.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.fleet.fleet import Fleet
from tests.fleet.fleet_fixtures import ONE, ROOT, active, link, put_back
from tests.fleet.test_status_truth import row

pytestmark = [pytest.mark.fleet, pytest.mark.slow]
CT, UNIT = ONE.name, f"ddtree-{ONE.name}.service"
FAKE = "0.0.0-fakebroken"           # a release directory whose server exits 1 at once


def ddtctl(fleet: Fleet, *args: str, src=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """ddtctl from the fleet's snapshot (or from `src`, a snapshot with another server)."""
    env = fleet.env()
    if src is not None:
        env["PYTHONPATH"] = str(src)
    res = subprocess.run([sys.executable, "-m", "ddtctl", *args], env=env, capture_output=True, text=True,
                         cwd=fleet.base, timeout=timeout, stdin=subprocess.DEVNULL)
    print(f"ddtctl {' '.join(args)}: exit {res.returncode}\n{res.stderr[-3000:]}")
    return res


def deploy_json(fleet: Fleet, *args: str, src=None) -> tuple[int, dict, str]:
    res = ddtctl(fleet, "deploy", CT, "--no-smoke", "--json", *args, src=src)
    return res.returncode, json.loads(res.stdout)["hosts"][0], res.stderr


def set_link(fleet: Fleet, name: str, release: str) -> None:
    assert fleet.exec(CT, "ln", "-sfn", f"releases/{release}", f"{ROOT}/{name}").returncode == 0


@pytest.fixture(scope="module")
def rfleet(one_ct_fleet):
    """The shared ct330 with FAKE beside its good release."""
    fleet = one_ct_fleet
    script = "#!/bin/sh\necho 'fake release: cannot start' >&2\nexit 1\n"
    made = fleet.exec(CT, "sh", "-c", 'mkdir -p "$1/venv/bin" && printf %s "$2" > "$1/venv/bin/ddtree-server" '
                      '&& chmod 755 "$1/venv/bin/ddtree-server" && touch "$1/.complete"', "sh",
                      f"{ROOT}/releases/{FAKE}", script)
    assert made.returncode == 0, made.stderr
    return fleet


@pytest.fixture(scope="module")
def broken_src(rfleet):
    """A snapshot of this checkout whose server's `serve` exits 1 before loading anything (its
    `--version` still works, so the release installs like any other)."""
    src = rfleet.base / "src-broken"
    shutil.copytree(rfleet.base / "src", src)
    serve = src / "server" / "ddtree_server" / "commands" / "serve.py"
    serve.write_text(serve.read_text() + "\n\ndef run_server(config):  # test release: cannot start\n"
                     "    raise SystemExit('broken test release: refusing to serve')\n")
    return src


@pytest.fixture
def healthy(rfleet):
    """Before each test: ct330 active on the good release (put back only when a test left it
    otherwise: after the module's last test nothing needs it, and a start costs seconds of CPU)."""
    put_back(rfleet)
    return rfleet


def test_failed_deploys_in_a_row_are_rolled_back_and_never_leave_the_service_down(healthy, broken_src):
    """The last deploy also gives a 1 s `--timeout`: its rollback waits for the good server (a
    start takes seconds) under its own deadline, not the deploy's (one round more would cost one
    more start of SmolLM2)."""
    fleet = healthy
    attempts = 0
    for attempt in range(3):       # 2 starts per failed deploy: past StartLimitBurst=5 without reset-failed
        code, host, err = deploy_json(fleet, *(["--timeout", "1"] if attempt == 2 else []), src=broken_src)
        attempts += 1
        assert code == 1 and not host["ok"] and host["rolled_back"], (attempt, host["steps"], err[-3000:])
        steps = {s["name"]: s for s in host["steps"]}
        assert steps["restart"]["status"] == "failed" and steps["rollback"]["status"] == "changed", host["steps"]
        assert active(fleet) and link(fleet, "current") == fleet.good, (attempt, fleet.journal(CT, 30))
    assert attempts == 3
    assert host.get("current_release") == fleet.good and host["release"] != fleet.good
    assert host.get("service", "").startswith("active"), host.get("service")
    row = next(line for line in err.splitlines() if line.startswith(f"│ {CT}"))
    assert f"{fleet.good} ({host['release']} rolled back)" in row and "failed (rolled back)" in row


def refuse_by_start_limit(fleet: Fleet) -> None:
    """Six starts in a row of a release that exits at once: the 6th is refused (5 in 600 s), and
    stays refused after the operator has put the good release back."""
    set_link(fleet, "current", FAKE)
    for _ in range(6):
        fleet.exec(CT, "systemctl", "restart", UNIT)
    assert "Start request repeated too quickly." in fleet.journal(CT, 10)
    set_link(fleet, "current", fleet.good)
    assert fleet.exec(CT, "systemctl", "start", UNIT).returncode == 1      # systemd alone: still refused


def test_start_recovers_a_unit_refused_by_its_start_limit(healthy):
    fleet = healthy
    refuse_by_start_limit(fleet)
    res = ddtctl(fleet, "status", CT, "--json", "--no-gpu")     # status says why it is down
    unit = json.loads(res.stdout)["hosts"][0]["unit"]
    assert res.returncode == 1 and unit["active"] == "failed" and unit["start_limit_hit"], unit
    assert "start limit hit" in row(res.stderr, CT)          # the status table's row, wrapped cells joined
    res = ddtctl(fleet, "start", CT)
    assert res.returncode == 0 and active(fleet), res.stderr
    assert f"{CT}: start {UNIT}: active" in res.stderr


def test_deploy_recovers_a_unit_refused_by_its_start_limit(healthy):
    fleet = healthy
    refuse_by_start_limit(fleet)
    code, host, err = deploy_json(fleet)                       # nothing changed: the unit is just started
    assert code == 0 and host["ok"] and host["restarted"] and not host["changed"], (host["steps"], err[-2000:])
    assert active(fleet)


def test_rollback_command_whose_previous_release_fails_restores_links_and_service(healthy):
    fleet = healthy
    set_link(fleet, "previous", FAKE)
    pid = fleet.show(CT)["MainPID"]
    res = ddtctl(fleet, "rollback", CT, "--json", "--timeout", "120")
    assert res.returncode == 1, res.stderr
    assert (link(fleet, "current"), link(fleet, "previous")) == (fleet.good, FAKE)       # links restored
    assert active(fleet) and fleet.show(CT)["MainPID"] != pid                           # good one restarted
    doc = json.loads(res.stdout)
    assert not doc["ok"]
    assert doc["current"] == fleet.good and doc["service"].startswith("active"), doc
    assert f"rollback to {FAKE} failed" in res.stderr and "links restored" in res.stderr
    assert "fake release: cannot start" in res.stderr                                   # its log lines
    assert "Traceback" not in res.stderr


def test_deploy_whose_rollback_fails_too_says_so_and_restores_the_links(healthy, broken_src):
    fleet = healthy
    set_link(fleet, "current", FAKE)                 # the release running before the deploy is broken too
    fleet.exec(CT, "systemctl", "restart", UNIT)
    before_previous = link(fleet, "previous")
    code, host, err = deploy_json(fleet, src=broken_src)
    steps = {s["name"]: s for s in host["steps"]}
    assert code == 1 and host["rolled_back"] and steps["rollback"]["status"] == "failed", (host, err[-3000:])
    assert (link(fleet, "current"), link(fleet, "previous")) == (FAKE, before_previous)
    # failed, or waiting for systemd's next automatic restart (Restart=on-failure) of the broken release
    service = host.get("service") or ""
    assert host.get("current_release") == FAKE and "Result: exit-code" in service, host
    assert service.split()[0] in ("failed", "activating"), service
    assert "rollback failed" in host["error"] and f"service now {service}" in err
    row = next(line for line in err.splitlines() if line.startswith(f"│ {CT}"))
    assert "rollback failed" in row and f"{FAKE} ({host['release']} rolled back)" in row
