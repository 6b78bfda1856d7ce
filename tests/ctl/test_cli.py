"""The ddtctl CLI driven in-process with typer's CliRunner: help, inventory errors, render, dry runs,
exit codes. Only the local host is ever acted on; container entries use loopback addresses and
are only rendered or validated, never contacted."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ddtctl import __version__
from ddtctl.cli.app import app

INVENTORY = """\
nodes:
  node1:
    address: 127.0.0.1
    port: 1
containers:
  ct200:
    vmid: 200
    node: node1
    address: 127.0.0.2
    groups: [gpu]
    service:
      kind: ddtree
      port: 8000
      gpus: [0]
      mode: ddtree
      tree_budget: 64
      target: {path: /models/Qwen3-8B}
      drafter: {path: /models/Qwen3-8B-DFlash}
      environment: {NOTE: "100% $HOME"}
local:
  here:
    service: {kind: ddtree, port: PORT, device: cpu, dtype: fp32, ready_timeout_s: 5}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp DDTCTL_HOME and a temp inventory selected through DDTCTL_INVENTORY."""
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY.replace("PORT", str(_free_port())))
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DDTCTL_INVENTORY", str(inv))
    return tmp_path


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def test_help_and_version() -> None:
    res = invoke("--help")
    assert res.exit_code == 0
    for command in ("deploy", "status", "wait-ready", "smoke", "render", "logs", "exec", "start", "stop",
                    "restart", "rollback", "releases", "inventory"):
        assert command in res.stdout
    assert "Exit codes: 0 ok" in res.stdout
    assert "Example: ddtctl deploy local" in invoke("deploy", "--help").stdout
    assert invoke("--version").stdout == f"ddtctl {__version__}\n"


def test_inventory_shows_hosts(env: Path) -> None:
    res = invoke("inventory", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert list(doc["hosts"]) == ["ct200", "here"]
    assert doc["hosts"]["ct200"]["vmid"] == 200 and doc["groups"]["gpu"] == ["ct200"]
    human = invoke("inventory")
    assert "ct200" in human.stderr and "ok (2 hosts, 1 nodes)" in human.stderr


def test_broken_inventory_is_exit_2_with_file_line_key(env: Path) -> None:
    bad = env / "bad.yaml"
    bad.write_text(INVENTORY.replace("vmid: 200", "vmid: 42").replace("port: PORT", "port: 8411"))
    for args in (["-i", str(bad), "inventory"], ["-i", str(bad), "deploy", "here", "--dry-run"],
                 ["--inventory", str(bad), "status", "--all"]):
        res = invoke(*args)
        assert res.exit_code == 2
        assert f"{bad}:7: containers.ct200.vmid: Input should be greater than or equal to 100" in res.stderr
        assert "Traceback" not in res.output and res.stdout == ""


def test_missing_inventory(env: Path) -> None:
    res = invoke("-i", str(env / "nope.yaml"), "inventory")
    assert res.exit_code == 2 and "cannot read inventory" in res.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["deploy"], "name a HOST or group, or pass --all"),
    (["deploy", "ct20x"], "unknown host or group 'ct20x'; did you mean 'ct200'?"),
    (["status", "--limit", "zzz*", "--all"], "no hosts selected (--limit 'zzz*' matched none)"),
    (["render", "--all"], "No such option: --all"),
    (["logs", "gpu", "here"], "Got unexpected extra argument"),
])
def test_selection_errors(env: Path, args: list[str], message: str) -> None:
    res = invoke(*args)
    assert res.exit_code == 2
    assert message in res.stderr


def test_render_container_unit(env: Path) -> None:
    res = invoke("render", "ct200")
    assert res.exit_code == 0
    out = res.stdout
    assert out.startswith("# /etc/systemd/system/ddtree.service\n")
    assert "ExecStart=/opt/ddtree/current/venv/bin/ddtree-server serve \\\n    --host 0.0.0.0 \\\n" in out
    assert "    --target /models/Qwen3-8B \\\n    --drafter /models/Qwen3-8B-DFlash \\\n" in out
    assert "    --mode ddtree \\\n    --tree-budget 64\n" in out
    assert 'Environment="CUDA_VISIBLE_DEVICES=0"' in out and "Type=notify" in out
    assert '# /opt/ddtree/ddtree.env\n' in out and 'NOTE="100% \\$HOME"' in out


def test_render_local_spec(env: Path) -> None:
    res = invoke("render", "here")
    assert res.exit_code == 0
    spec = json.loads(res.stdout.split("\n", 1)[1])
    assert spec["argv"][0] == str(env / "home" / "hosts" / "here" / "current" / "venv" / "bin" / "ddtree-server")
    assert spec["argv"][1:3] == ["serve", "--host"] and "--device" in spec["argv"]


def test_deploy_dry_run_changes_nothing(env: Path) -> None:
    res = invoke("deploy", "here", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    host = doc["hosts"][0]
    assert (host["dry_run"], host["changed"], host["restarted"], host["weights_bytes_sent"]) == (True, True, False, 0)
    steps = {s["name"]: s["status"] for s in host["steps"]}
    assert steps == {"release": "planned", "current": "planned", "unit": "planned", "restart": "planned"}
    assert host["release"].startswith("0.") and host["url"].startswith("http://127.0.0.1:")
    assert any(path.endswith("service.json") for path in host["diffs"])
    assert not (env / "home").exists()                # nothing written, not even the wheel cache
    assert "release          planned" in res.stderr


def test_service_commands_on_a_host_never_deployed(env: Path) -> None:
    res = invoke("status", "here", "--json", "--no-gpu")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    host = doc["hosts"][0]
    assert doc["ok"] is False and host["unit"]["active"] == "inactive" and host["unit"]["installed"] is False
    assert (host["verdict"], host["cause"]) == ("not installed", "no service installed: deploy it (ddtctl deploy here)")
    assert "not installed" in res.stderr
    assert invoke("logs", "here").stdout == ""
    res = invoke("wait-ready", "here", "--timeout", "5")
    assert res.exit_code == 1 and "ddtree.service is not installed (deploy it: ddtctl deploy here)" in res.stderr
    res = invoke("start", "here")
    assert res.exit_code == 1 and "no service installed" in res.stderr and "run `ddtctl deploy`" in res.stderr
    res = invoke("rollback", "here")
    assert res.exit_code == 2 and "no previous release to roll back to" in res.stderr
    res = invoke("rollback", "here", "--json")        # machine-readable failure, same exit code
    doc = json.loads(res.stdout)
    assert res.exit_code == 2 and doc["ok"] is False and doc["host"] == "here" and "no previous release" in doc["error"]
    res = invoke("releases", "here", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["releases"] == []


def _status_row(res) -> str:
    return next(line for line in res.stderr.splitlines() if "here" in line)


def test_status_after_stop_says_stopped_not_failed(env: Path) -> None:
    """A service stopped on purpose is `stopped` in the ready column (exit 1: not serving); one that
    died on its own is still `failed`."""
    import sys
    import time

    from ddtctl.ops.units import ServiceSpec, render_local

    def install(code: str) -> None:
        sv = env / "home" / "supervisor" / "here"
        sv.mkdir(parents=True, exist_ok=True)
        spec = ServiceSpec("ddtree.service", "ddtree", "t", [sys.executable, "-c", code], {},
                           str(env / "t.env"), working_dir=str(env))
        (sv / "service.json").write_text(render_local(spec))

    install("import time; time.sleep(600)")
    assert invoke("start", "here").exit_code == 0
    res = invoke("stop", "here")
    assert res.exit_code == 0 and "stop ddtree.service: inactive" in res.stderr
    res = invoke("status", "here", "--no-gpu")
    assert res.exit_code == 1
    row = _status_row(res)
    assert "inactive" in row and "stopped" in row and "failed" not in row
    host = json.loads(invoke("status", "here", "--no-gpu", "--json").stdout)["hosts"][0]
    assert (host["stopped"], host["ready"], host["ok"], host["ready_detail"]) == (
        True, False, False, "service inactive: start it (ddtctl start here)")
    assert (host["verdict"], host["cause"]) == ("stopped", "service inactive: start it (ddtctl start here)")
    assert "start it" in row                                         # the cause is in the table too
    res = invoke("smoke", "here")                                    # no eight fail rows: start it
    assert res.exit_code == 1 and "smoke not run: ddtree.service is inactive" in res.stderr, res.stderr
    assert "start it first: ddtctl start here" in res.stderr and "chat_fact" not in res.stderr

    install("import sys; sys.exit(3)")
    assert invoke("start", "here").exit_code == 0
    deadline = time.monotonic() + 20
    while (res := invoke("status", "here", "--no-gpu", "--json")).exit_code == 1 and \
            json.loads(res.stdout)["hosts"][0]["unit"]["active"] != "failed":
        assert time.monotonic() < deadline, "the service did not fail"
        time.sleep(0.2)
    host = json.loads(res.stdout)["hosts"][0]
    assert res.exit_code == 1 and host["stopped"] is False and host["verdict"] == "failed"
    assert host["ready_detail"] == host["cause"] == "service failed (dead) [Result: exit-code]"
    row = _status_row(invoke("status", "here", "--no-gpu"))
    assert "stopped" not in row and "failed (exit-code)" in row and "failed: service failed" in row


def test_exec_relays_argv_output_and_status(env: Path) -> None:
    res = invoke("exec", "here", "--", "sh", "-c", 'printf "%s|%s" "$0" "$1"; exit 3', "a b", "$HOME")
    assert res.exit_code == 3
    assert res.stdout == "a b|$HOME"
    res = invoke("exec", "here")
    assert res.exit_code == 2 and "give a command after --" in res.stderr
    res = invoke("exec", "here", "--json", "--", "echo", "hi")
    assert res.exit_code == 2 and "exec takes no options after HOST (got '--json')" in res.stderr
    res = invoke("exec", "here", "--json")
    assert res.exit_code == 2 and res.stdout == "" and "--json" in res.stderr


def test_smoke_unreachable_node_fails_fast_with_exit_3(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time
    empty = env / "ssh_config"
    empty.write_text("")
    monkeypatch.setenv("DDTCTL_SSH_CONFIG", str(empty))
    started = time.monotonic()
    res = invoke("smoke", "ct200")
    assert res.exit_code == 3, res.stderr
    assert "ct200: node:node1: cannot connect" in res.stderr and "Traceback" not in res.stderr
    # the other host (nothing listening on its port) is still reported, and fast
    res = invoke("smoke", "ct200", "here", "--json")
    assert time.monotonic() - started < 60
    doc = json.loads(res.stdout)
    assert res.exit_code == 5 and "cannot connect" in doc["errors"]["ct200"]
    (here,) = doc["hosts"]
    assert here["host"] == "here" and not here["ok"]
    assert all(c["seconds"] < 10 for c in here["checks"])
    assert here["checks"][-1]["detail"].startswith("not run: service unreachable")


def test_status_unreachable_host_is_exit_3_with_the_connection_error(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time
    empty = env / "ssh_config"
    empty.write_text("")
    monkeypatch.setenv("DDTCTL_SSH_CONFIG", str(empty))
    started = time.monotonic()
    res = invoke("status", "ct200", "here", "--json", "--no-gpu")
    assert time.monotonic() - started < 30
    assert res.exit_code == 3, res.stderr
    ct, here = json.loads(res.stdout)["hosts"]
    assert ct["unreachable"] is True and ct["ready_detail"] == "unreachable"
    assert ct["unreachable_cause"] and any(e.startswith("unreachable: ") for e in ct["errors"])
    assert not any("Timeout" in e for e in ct["errors"])
    assert here["unreachable"] is False and here["host"] == "here"


def test_unusable_ddtctl_home_is_one_line_exit_2(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDTCTL_HOME", "/dev/null/x")
    res = CliRunner().invoke(app, ["deploy", "here", "--no-smoke"])
    assert res.exit_code == 2, (res.stderr, res.exception)
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "/dev/null/x (DDTCTL_HOME) is not usable: Not a directory" in res.stderr


@pytest.mark.parametrize("args", [
    ["wait-ready", "here", "--timeout", "inf"],
    ["deploy", "here", "--timeout", "inf"],
    ["deploy", "here", "--rollback-timeout", "1e400"],
    ["rollback", "here", "--timeout", "inf"],
    ["exec", "--timeout", "inf", "here", "--", "true"],
])
def test_an_infinite_timeout_is_a_usage_error(env: Path, args: list[str]) -> None:
    """Every deadline must end (like the inventory's ready_timeout_s): `--timeout inf` is exit 2
    before anything runs, not a wait without bound."""
    res = invoke(*args)
    assert res.exit_code == 2, res.output
    assert "finite" in res.output, res.output
