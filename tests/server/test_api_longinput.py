"""End-to-end (the real server process): long inputs and the shutdown of queued requests.

* a prompt longer than the context window is a 400 before any work; a text that cannot fit even
  at the tokenizer's longest token is a 400 before it is tokenised (the server's peak memory does
  not grow by the tokenisation of 10 MB); a body over the limit is a 413 JSON error;
* a long prefill is progress: /health stays 200 while one prefill runs longer than --stall-seconds;
* that server's --max-tree-budget 4 caps the default budget and refuses larger ones, and /health
  and /metrics report its load (one server for both: --max-tree-budget does not touch a prefill).

(Queued requests at the drain deadline: tests/server/test_api_lifecycle.py, on the drain test's server.)
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.serverproc import API_KEY, MAX_MODEL_LEN, MODEL, ServerProcess

pytest_plugins = ["tests.server.api_fixtures"]
pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STALL_S = 2   # --stall-seconds of the long-prefill test


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _post(server: ServerProcess, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url(path), json=body, headers=AUTH, timeout=timeout)


def test_prompt_longer_than_the_context_is_400_before_any_work(api_server):
    ids = [1000 + i % 3000 for i in range(MAX_MODEL_LEN + 5)]
    resp = _post(api_server, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert f"{MAX_MODEL_LEN + 5} tokens" in err["message"] and f"{MAX_MODEL_LEN} tokens" in err["message"]
    # counted exactly after tokenising: a text under the character bound but over the window
    text = " hello" * (MAX_MODEL_LEN + 50)
    resp = _post(api_server, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    assert "tokens but the context window" in resp.json()["error"]["message"]
    health = httpx.get(api_server.url("/health"), timeout=30).json()
    assert health["running"] == 0 and health["queued"] == 0


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_text_that_cannot_fit_is_refused_before_tokenising(api_server, kind):
    text = "x" * (10 * 1024 * 1024)   # 10 MB: under the 16 MiB body limit, far over 1024 tokens
    before = _peak_rss_kib(api_server.proc.pid)
    body = ({"model": MODEL, "prompt": text, "max_tokens": 1} if kind == "completion" else
            {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1})
    resp = _post(api_server, "/v1/completions" if kind == "completion" else "/v1/chat/completions", body)
    assert resp.status_code == 400, resp.text[:300]
    err = resp.json()["error"]
    assert err["code"] == "context_length_exceeded" and "was not tokenised" in err["message"]
    assert err["param"] == ("prompt" if kind == "completion" else "messages")
    # tokenising 10 MB would take the server's peak memory up by ~650 MB; parsing the body does not
    grown_mib = (_peak_rss_kib(api_server.proc.pid) - before) / 1024
    assert grown_mib < 300, grown_mib


def test_body_over_the_limit_is_a_413_json_error(api_server):
    body = json.dumps({"model": MODEL, "prompt": "y" * (17 * 1024 * 1024), "max_tokens": 1})
    resp = httpx.post(api_server.url("/v1/completions"), content=body, timeout=120,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


@pytest.fixture(scope="module")
def prefill_server():
    """--stall-seconds 2 --prefill-chunk 0 (the long-prefill test) --max-tree-budget 4 (the cap)."""
    with ServerProcess("--stall-seconds", str(STALL_S), "--prefill-chunk", "0", "--max-tree-budget", "4") as server:
        yield server


def test_real_server_caps_the_budget_and_reports_its_load(prefill_server):
    server = prefill_server
    http = httpx.Client(base_url=server.base_url, timeout=300)
    card = http.get("/v1/models").json()["data"][0]
    assert card["decoding"]["max_tree_budget"] == 4
    if card["decoding"]["default_mode"] == "ddtree":   # the shipped drafter: default 15 lowered to 4
        assert card["decoding"]["tree_budget"] == 4
        assert "default tree budget 15 lowered to --max-tree-budget 4" in server.log_text()
    refused = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                 "decoding": {"tree_budget": 4096}})
    assert refused.status_code == 400 and "limit of 4 nodes" in refused.json()["error"]["message"]
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["stall_seconds"] == STALL_S and "round_age_s" in health
    assert "ddtree_round_age_seconds" in http.get("/metrics").text


def test_a_long_prefill_is_progress_not_a_stall(prefill_server):
    """--stall-seconds 2 and a 1500-token prompt whose one prefill round runs longer (about 8 s on
    one quiet core, 15 s on a busy one): /health stays 200 while the round's age passes 2 s (its
    layers and their modules keep starting: several times per layer, 30 layers, under half a
    second apart), and the request completes. ``--prefill-chunk 0``: the whole prompt in one
    round (chunked, each chunk is its own short round: tests/server/test_chunked_serving.py)."""
    server = prefill_server
    ids = [1000 + i % 3000 for i in range(1500)]
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(resp=httpx.post(
        server.url("/v1/completions"), json={"prompt": ids, "max_tokens": 2, "temperature": 0}, timeout=900)))
    worker.start()
    polls = []
    while worker.is_alive():
        health = httpx.get(server.url("/health"), timeout=30)
        polls.append((health.status_code, health.json()))
        time.sleep(0.2)
    worker.join()
    assert result["resp"].status_code == 200, result["resp"].text
    ages = [body["round_age_s"] or 0 for _, body in polls]
    assert max(ages) > STALL_S, f"the prefill took under --stall-seconds ({max(ages)} s): not a long prefill"
    bad = [(code, body) for code, body in polls if code != 200]
    assert not bad, bad[:2]
    assert all(body["quiet_s"] is None or body["quiet_s"] < STALL_S for _, body in polls)
