"""End-to-end: 64 concurrent streams on the real server share batched engine steps.

The real server (default SmolLM2 + shipped drafter, CPU fp32) with ``--max-running 64``: 64
streaming clients with different prompts, lengths and decoding modes. Every stream gets exactly
the text of the same request sent alone, and the engine ran them together: the number of decode
steps is about that of the longest request (one request at a time would need the sum of all of
them), read from the server's step metrics.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.serverproc import ServerProcess

pytestmark = pytest.mark.slow

N = 64
MODES = ("ar", "dflash", "ddtree")


def max_tokens(i: int) -> int:
    """6 to 17 tokens: several verify rounds of every speculative stream, lengths that differ."""
    return 6 + i % 12


def _metric(server: ServerProcess, pattern: str) -> float:
    text = httpx.get(server.url("/metrics"), timeout=30).text
    match = re.search(rf"^{pattern} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_64_concurrent_streams_run_batched_and_equal_alone():
    server = ServerProcess("--max-running", str(N), "--max-queue", str(N), "--max-model-len", "256").start()
    try:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=900)
        model = client.models.list().data[0].id

        def one(i: int) -> str:
            stream = client.completions.create(
                model=model, prompt=f"Item {i}: the number {i * 7} is", max_tokens=max_tokens(i), temperature=0,
                stream=True, extra_body={"ignore_eos": True, "decoding": {"mode": MODES[i % 3]}})
            return "".join(c.choices[0].text for c in stream if c.choices)

        with ThreadPoolExecutor(N) as pool:
            together = list(pool.map(one, range(N)))
        steps = _metric(server, r'ddtree_step_seconds_count\{kind="decode"\}')
        longest = max(max_tokens(i) for i in range(N))
        assert steps <= 3 * longest, (steps, longest)   # one at a time: > sum(max_tokens) / tau steps
        for i in (0, 1, 2, 11, 63):                      # alone (the server idle otherwise)
            assert one(i) == together[i], i
    finally:
        server.stop()
