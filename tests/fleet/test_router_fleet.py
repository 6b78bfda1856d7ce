"""A router fleet end to end: two real ddtree-server backends and the real sglang-router, each in an
emulated container (real sshd, pct/systemctl emulations; tests/fleet/fleet.py), deployed, checked
and degraded with the ddtctl CLI, and used with the official `openai` client.

Tests run in file order on one deployment: deploy --all (the router's release venv, its unit with
both backends) -> status shows the router and each backend -> smoke through the router -> one
backend is stopped and the openai client keeps getting answers; status says `degraded` naming it
-> the group changes (the stopped backend leaves it) and a deploy re-renders and restarts the router.
Needs the test fleet's requirements and the `sglang-router` wheel installed in this Python (the
containers see this machine's interpreter read-only, `packages: {mode: system}`).
"""

from __future__ import annotations

import importlib.util
import json
import time

import openai
import pytest
import yaml

from tests.fleet.fleet import CtSpec, Fleet
from tests.fleet.node import fleet_available
from tests.fleet.sshd import free_port

pytestmark = [pytest.mark.fleet, pytest.mark.slow]
SPECS = (CtSpec("rb1", 601, "rt-a", None, "h200"), CtSpec("rb2", 602, "rt-a", None, "h200"),
         CtSpec("rr", 610, "rt-a", None, "h200"))
MODEL = "SmolLM2-135M-Instruct"


class RouterFleet(Fleet):
    """rb1 + rb2 serve the embedded SmolLM2 (group `pool`); rr routes to `pool`."""

    members = ["rb1", "rb2"]

    def inventory_doc(self) -> dict:
        doc = super().inventory_doc()
        rr = self.specs["rr"]
        doc["containers"]["rr"]["service"] = {
            "kind": "router", "backends": "pool", "port": rr.port, "bind": "127.0.0.1", "unit": rr.unit,
            "metrics_port": self.metrics_port, "policy": "round_robin", "health_check_interval_s": 1,
            "python": doc["containers"]["rb1"]["service"]["python"], "packages": {"mode": "system"},
            "ready_timeout_s": 600}
        doc["groups"] = {"pool": list(self.members)}
        return doc


def run_json(fleet, *args: str, timeout: float = 900) -> tuple[int, dict, str]:
    res = fleet.ddtctl(*args, "--json", timeout=timeout)
    try:
        return res.returncode, json.loads(res.stdout), res.stderr
    except ValueError:
        pytest.fail(f"no JSON on stdout (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    reason = fleet_available() or (None if importlib.util.find_spec("sglang_router") else
                                   "sglang-router is not installed (pip install sglang-router==0.3.2)")
    if reason:
        pytest.skip(reason)
    f = RouterFleet(tmp_path_factory.mktemp("router-fleet"), specs=SPECS)
    f.metrics_port = free_port()
    try:
        yield f.start()
    finally:
        f.close()


@pytest.fixture(scope="module")
def deployed(fleet):
    return run_json(fleet, "deploy", "--all", "--no-smoke", "-p", "3")


def ask(client: openai.OpenAI) -> str:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=12, temperature=0)
    return r.choices[0].message.content


def test_deploy_installs_the_router_in_front_of_both_backends(fleet, deployed):
    code, doc, err = deployed
    assert code == 0, err[-4000:]
    rr = {h["host"]: h for h in doc["hosts"]}["rr"]
    assert rr["release"].startswith("sglang-router-0.3.2-") and rr["current_release"] == rr["release"]
    steps = {s["name"]: s for s in rr["steps"]}
    assert steps["release"]["status"] == "changed" and steps["wait-ready"]["status"] == "ok"
    unit = fleet.exec("rr", "cat", f"/etc/systemd/system/{fleet.specs['rr'].unit}").stdout
    for name in ("rb1", "rb2"):
        assert f"http://127.0.0.1:{fleet.specs[name].port}" in unit
    assert "--health-check-endpoint /ready" in unit and "--disable-circuit-breaker" in unit


def test_status_goes_through_the_router_and_each_backend(fleet, deployed):
    code, doc, err = run_json(fleet, "status", "--all", "--no-gpu")
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert code == 0, err[-3000:]
    rr = hosts["rr"]
    assert rr["verdict"] == "ok" and rr["models"] == [MODEL] and rr["release"].startswith("sglang-router-")
    assert [(b["name"], b["ready"], b["router"]) for b in rr["backends"]] == [("rb1", True, True), ("rb2", True, True)]
    assert not rr["version_mismatch"]


def test_smoke_through_the_router(fleet, deployed):
    code, doc, err = run_json(fleet, "smoke", "rr")
    assert code == 0, err[-3000:]
    checks = {c["name"]: c for c in doc["hosts"][0]["checks"]}
    assert checks["models"]["detail"].startswith("2/2 backends healthy")
    assert checks["chat_fact"]["status"] == "pass" and checks["stream_equal"]["status"] == "pass"
    assert checks["acceptance"]["status"] == "pass"          # the backends' `decoding` passes through


def test_a_stopped_backend_leaves_the_clients_answered(fleet, deployed):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{fleet.specs['rr'].port}/v1", api_key="none",
                           max_retries=0, timeout=120)
    assert all("Paris" in ask(client) for _ in range(4))
    res = fleet.ddtctl("stop", "rb2", timeout=300)
    assert res.returncode == 0, res.stderr
    answers = [ask(client) for _ in range(8)]               # no retry in the client: the router's own
    assert all("Paris" in a for a in answers), answers
    time.sleep(4)                                          # the router's health checks (1 s x 3 failures)
    code, doc, err = run_json(fleet, "status", "rr", "--no-gpu")
    rr = doc["hosts"][0]
    assert code == 1 and rr["verdict"] == "degraded" and not rr["ok"], rr
    assert "1/2 backends ready" in rr["cause"] and "rb2" in rr["cause"]
    assert [b["ready"] for b in rr["backends"]] == [True, False]


def test_a_group_change_restarts_the_router_with_the_new_backends(fleet, deployed):
    fleet.members = ["rb1"]
    fleet.inventory.write_text(yaml.safe_dump(fleet.inventory_doc(), sort_keys=False))
    code, doc, err = run_json(fleet, "deploy", "rr", "--dry-run")
    steps = {s["name"]: s["status"] for s in doc["hosts"][0]["steps"]}
    assert code == 0 and steps["release"] == "ok" and steps["unit"] == "planned" and steps["restart"] == "planned", err
    code, doc, err = run_json(fleet, "deploy", "rr", "--no-smoke")
    assert code == 0, err[-3000:]
    rr = doc["hosts"][0]
    assert rr["restarted"] and {s["name"]: s["status"] for s in rr["steps"]}["unit"] == "changed"
    assert f"127.0.0.1:{fleet.specs['rb2'].port}" in next(iter(rr["diffs"].values()))
    code, doc, err = run_json(fleet, "status", "rr", "--no-gpu")
    assert code == 0 and [b["name"] for b in doc["hosts"][0]["backends"]] == ["rb1"], err[-2000:]
