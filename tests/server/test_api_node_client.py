"""A second client library: the npm `openai` package drives a multi-turn tool conversation
(tests/server/node/tool_conversation.cjs) against the real server.

The package is installed by `make install-test` (target `node-client`) into
.cache/node-openai; when it is missing the test installs it there itself, and skips when
node or the npm registry is not available. Nothing of it is committed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.server.serverproc import API_KEY, MODEL

pytest_plugins = ["tests.server.api_fixtures"]
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PREFIX = ROOT / ".cache" / "node-openai"
VERSION = "7.59.0"   # same pin as the Makefile's node-client target
SCRIPT = Path(__file__).with_name("node") / "tool_conversation.cjs"


@pytest.fixture(scope="module")
def node_modules() -> Path:
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    modules = PREFIX / "node_modules"
    if not (modules / "openai" / "package.json").is_file():
        if shutil.which("npm") is None:
            pytest.skip("npm is not installed")
        PREFIX.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(PREFIX),
                               f"openai@{VERSION}"], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"npm install openai failed: {done.stderr.strip()[-300:]}")
    return modules


def test_npm_openai_client_multi_turn_tool_conversation(api_server, node_modules):
    done = subprocess.run([shutil.which("node"), str(SCRIPT), api_server.url("/v1"), API_KEY, MODEL],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OPENAI_NODE_MODULES": str(node_modules)})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    for turn in ("streamed", "plain"):
        assert out[turn]["finish_reason"] == "tool_calls", out[turn]
        [call] = out[turn]["message"]["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert not out["streamed"]["message"]["content"] and out["plain"]["message"]["content"] is None
    answer = out["answer"]
    assert answer["finish_reason"] == "stop" and "Oslo" in answer["message"]["content"]
    assert out["error"]["status"] == 400 and out["error"]["name"] == "BadRequestError"
    assert "matches no tool call" in out["error"]["message"]
