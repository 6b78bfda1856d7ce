"""``bench.http_load`` against the real server (the shared SmolLM2 server of the API tests): the
closed loop serves every prompt, counts the completion tokens the server reports, and a plain
row is the ratio's reference."""

from __future__ import annotations

import asyncio

import pytest
from ddtree_server.bench import http_load

from tests.server.serverproc import API_KEY, MODEL

pytest_plugins = ["tests.server.api_fixtures"]
pytestmark = pytest.mark.slow

PROMPTS = ["Count to five.", "Name a colour.", "What is 2+3?"]


def test_closed_loop_over_http_counts_every_token(api_server):
    row = asyncio.run(http_load.closed_loop(api_server.base_url, MODEL, PROMPTS, mode="ar", concurrency=2,
                                            max_tokens=6, api_key=API_KEY))
    assert row["requests"] == 3 and 3 <= row["tokens"] <= 18 and row["tokens_per_s"] > 0
    assert row["ttft_p50_ms"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"]
    rows = http_load.run(api_server.base_url, MODEL, PROMPTS[:2], [2], ["ar", "default"], 4, api_key=API_KEY,
                         log=lambda line: None)
    assert [(r["mode"], r["x_plain"] is not None) for r in rows] == [("ar", True), ("default", True)]
    assert rows[0]["x_plain"] == 1.0
    with pytest.raises(RuntimeError, match="HTTP 401"):
        asyncio.run(http_load.closed_loop(api_server.base_url, MODEL, PROMPTS[:1], mode="ar", concurrency=1,
                                          max_tokens=2))
