"""Busy vs stuck, and the tree-budget cap.

A request's `decoding.tree_budget` above `--max-tree-budget` is a 400 naming the limit; /health,
/ready and /metrics report the age of the engine round in progress and of the oldest queued
request, and /health turns 503 while one round has run longer than `--stall-seconds`. The stuck
round is produced by a drafter test double that blocks in `propose` (a hung device), on the real
Engine, Worker and app. The real server's cap and load report:
tests/server/test_api_longinput.py (on the long-prefill test's server)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from ddtree_server.cli import app as cli_app
from ddtree_server.config import ServerConfig
from tests.server.api_tiny import StallingDrafter, TinyApp, tiny_engine
from tests.server.tiny import VOCAB

STALL_S = 3.0


def _body(budget: int | None = None, **extra) -> dict:
    body = {"prompt": "ab", "max_tokens": 4, "temperature": 0, **extra}
    if budget is not None:
        body["decoding"] = {"mode": "ddtree", "tree_budget": budget}
    return body


@pytest.fixture(scope="module")
def tiny():
    app = TinyApp()
    yield app
    app.stop()


# ---- --max-tree-budget -------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [65, 100, 257, 4096])
def test_budget_above_the_default_cpu_limit_is_400(tiny, budget):
    response = tiny.request("POST", "/v1/completions", json=_body(budget))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "decoding.tree_budget" and error["code"] == "tree_budget_too_large"
    assert f"{budget}" in error["message"] and "limit of 64 nodes" in error["message"]
    assert "--max-tree-budget" in error["message"]


@pytest.mark.parametrize("budget", [1, 3, 64])
def test_budget_up_to_the_limit_runs(tiny, budget):
    response = tiny.request("POST", "/v1/completions", json=_body(budget))
    assert response.status_code == 200, response.text
    assert response.json()["decoding"]["tree_budget"] == budget


def test_model_card_names_the_limit(tiny):
    card = tiny.request("GET", "/v1/models").json()["data"][0]
    assert card["decoding"]["max_tree_budget"] == 64 and card["decoding"]["tree_budget"] == 3


def test_explicit_limit_also_caps_the_engine_default():
    app = TinyApp(tiny_engine(tree_budget=12), max_tree_budget=2)
    try:
        assert app.request("POST", "/v1/completions", json=_body(3)).status_code == 400
        plain = app.request("POST", "/v1/completions", json=_body(max_tokens=6, decoding={"mode": "ddtree"}))
        assert plain.status_code == 200 and plain.json()["decoding"]["tree_budget"] == 2
        assert app.request("GET", "/v1/models").json()["data"][0]["decoding"]["max_tree_budget"] == 2
    finally:
        app.stop()


def test_limit_defaults_by_device():
    assert ServerConfig(device="cpu").tree_budget_limit == 64
    assert ServerConfig(device="cuda").tree_budget_limit == 256
    assert ServerConfig(device="cuda", tree_budget=512).tree_budget_limit == 512   # --tree-budget raises it
    assert ServerConfig(device="cuda", max_tree_budget=1024).tree_budget_limit == 1024
    with pytest.raises(ValidationError, match="--tree-budget 128 is above --max-tree-budget 64"):
        ServerConfig(device="cpu", tree_budget=128, max_tree_budget=64)


@pytest.mark.parametrize("args, text", [
    (["--tree-budget", "128", "--max-tree-budget", "64"], "--tree-budget 128 is above --max-tree-budget 64"),
    (["--max-tree-budget", "0"], "error: --max-tree-budget:"),
    (["--max-tree-budget", "4097"], "error: --max-tree-budget:"),
    (["--stall-seconds", "0"], "error: --stall-seconds:"),
    (["--stall-seconds", "nan"], "error: --stall-seconds:"),
    (["--stall-seconds", "inf"], "error: --stall-seconds:"),
])
def test_serve_refuses_bad_limits_with_exit_2(args, text):
    # an unusable --host: if the values were accepted, serve would fail to bind (exit 1), never serve
    result = CliRunner().invoke(cli_app, ["serve", "--device", "cpu", "--host", "256.256.256.256", *args])
    assert result.exit_code == 2 and text in " ".join(result.output.split()), result.output


# ---- busy vs stuck -----------------------------------------------------------------------------

def test_health_tells_busy_from_stuck():
    drafter = StallingDrafter([[1, 2], [3]], vocab=VOCAB, hidden=64, layer_ids=[1, 2])
    app = TinyApp(tiny_engine(drafter), stall_seconds=STALL_S)

    async def scenario() -> None:
        async with app.client() as client:
            idle = (await client.get("/health")).json()
            assert idle["status"] == "ok" and idle["round_age_s"] is None and idle["oldest_queued_age_s"] is None
            assert idle["stall_seconds"] == STALL_S and idle["stalled"] is False

            drafter.armed.set()
            first = asyncio.create_task(client.post("/v1/completions", json=_body(max_tokens=8)))
            while not drafter.stuck.is_set():
                await asyncio.sleep(0.01)
            second = asyncio.create_task(client.post("/v1/completions", json=_body()))
            while app.worker.queued == 0:
                await asyncio.sleep(0.01)

            busy = await client.get("/health")   # a young round: busy, still healthy
            assert busy.status_code == 200, busy.text
            assert 0 <= busy.json()["round_age_s"] < STALL_S and busy.json()["oldest_queued_age_s"] >= 0
            assert busy.json()["running"] == 1 and busy.json()["queued"] == 1

            while app.worker.round_age() < STALL_S + 0.2:
                await asyncio.sleep(0.05)
            stuck = await client.get("/health")
            assert stuck.status_code == 503, stuck.text
            body = stuck.json()
            assert body["status"] == "unhealthy" and body["stalled"] is True and "stalled" in body["reason"]
            assert f"--stall-seconds {STALL_S:g}" in body["reason"]
            assert body["round_age_s"] >= STALL_S and body["oldest_queued_age_s"] >= STALL_S
            ready = await client.get("/ready")
            assert ready.status_code == 200 and ready.json()["round_age_s"] >= STALL_S and ready.json()["stalled"] is True
            metrics = (await client.get("/metrics")).text
            assert "ddtree_worker_stalled 1.0" in metrics
            assert _gauge(metrics, "ddtree_round_age_seconds") >= STALL_S
            assert _gauge(metrics, "ddtree_oldest_queued_age_seconds") >= STALL_S

            drafter.armed.clear()
            drafter.gate.set()   # the device recovers: both requests complete
            assert (await first).status_code == 200 and (await second).status_code == 200
            after = await client.get("/health")
            assert after.status_code == 200 and after.json()["round_age_s"] is None
            assert after.json()["oldest_queued_age_s"] is None and after.json()["reason"] is None
            assert "ddtree_worker_stalled 0.0" in (await client.get("/metrics")).text

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        drafter.gate.set()
        app.stop()


def _gauge(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])
