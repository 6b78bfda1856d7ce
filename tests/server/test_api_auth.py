"""API-key handling by class (hostile input): any Authorization header bytes give 200/401, never
a 500; an unusable key (non-ASCII, blank, whitespace, control characters) stops `serve` with exit 2
before anything loads, from `--api-key` and from `$DDTREE_API_KEY` alike; an empty key turns
authentication off and says so in the log."""

from __future__ import annotations

import asyncio
import signal
import socket

import httpx
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from ddtree_server.api.app import create_app
from ddtree_server.api.metrics import Metrics
from ddtree_server.api.worker import Worker
from ddtree_server.cli import app as cli_app
from ddtree_server.config import ServerConfig

pytest_plugins = ["tests.server.api_fixtures"]

KEY = "sk-test_key.123~+/="


def _get(headers: list[tuple[bytes, bytes]], api_key: str | None = KEY) -> httpx.Response:
    app = create_app(ServerConfig(device="cpu", api_key=api_key), Worker(load=None, warmup=None), Metrics())

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.get("/v1/models", headers=headers)

    return asyncio.run(go())


@pytest.mark.parametrize("value", [
    b"Bearer \xff", "Bearer ключ".encode(), "Bearer sk-test_key.123~+/=\u00e9".encode(), b"Bearer \xe9",
    b"\xff\xfe\xfd", b"Bearer " + b"\x80" * 5000, b"Bearer sk-test_key.123~+/=\x00", b"Bearer", b"",
    b"Basic " + KEY.encode(), b"Bearer sk-test_key.123~+/", KEY.encode(), b"Bearer  \t",
])
def test_any_wrong_authorization_bytes_are_401(value):
    response = _get([(b"authorization", value)])
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("value", [b"Bearer " + KEY.encode(), b"bearer " + KEY.encode(),
                                   b"BEARER   " + KEY.encode() + b" \t"])
def test_the_right_key_passes(value):
    assert _get([(b"authorization", value)]).status_code == 503   # past auth: the model is not loaded


def test_no_key_means_no_authentication():
    assert _get([(b"authorization", b"Bearer \xff")], api_key="").status_code == 503
    assert _get([], api_key=None).status_code == 503


BAD_KEYS = [("ключ", "non-ASCII"), ("sk-é", "non-ASCII"), ("   ", "blank"), ("\t", "blank"),
            ("sk test", "whitespace"), (" sk-test", "whitespace"), ("sk-test\n", "whitespace"),
            ("sk-\x00", "control character"), ("sk-\x1b[0m", "control character"), ("sk-\x7f", "control character")]


@pytest.mark.parametrize("key, reason", BAD_KEYS)
def test_config_refuses_unusable_keys(key, reason):
    with pytest.raises(ValidationError, match=reason):
        ServerConfig(device="cpu", api_key=key)


@pytest.mark.parametrize("via_env", [False, True])
@pytest.mark.parametrize("key, reason", BAD_KEYS[:3] + BAD_KEYS[4:5] + BAD_KEYS[8:9])
def test_serve_refuses_unusable_keys_with_exit_2(key, reason, via_env):
    # an unusable --host: if the key were accepted, serve would fail to bind (exit 1), never serve
    args = ["serve", "--device", "cpu", "--host", "256.256.256.256", "--port", "9"]
    env = {"DDTREE_API_KEY": key} if via_env else {}
    result = CliRunner().invoke(cli_app, args if via_env else [*args, "--api-key", key], env=env)
    assert result.exit_code == 2, (result.output, result.exception)
    text = " ".join(result.output.split())
    assert "error: --api-key: the API key" in text and reason in text and "DDTREE_API_KEY" in text
    assert "Traceback" not in result.output
    if key.strip():
        assert key.strip() not in result.output   # the secret is never echoed


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"DDTREE_API_KEY": ""}, {}])
def test_empty_key_logs_that_authentication_is_off(env, monkeypatch):
    from tests.server.serverproc import ServerProcess

    monkeypatch.delenv("DDTREE_API_KEY", raising=False)
    server = ServerProcess(env=env).start(wait=False)   # the line is logged before the model loads
    try:
        assert server.proc.poll() is None, server.log_tail()
        assert "authentication off: no API key" in server.log_text()
    finally:
        server.stop(signal.SIGKILL)   # SIGTERM would wait for the model load (~8 s) to finish


@pytest.mark.slow
def test_a_key_logs_that_authentication_is_on_without_the_key(monkeypatch):
    from tests.server.serverproc import ServerProcess

    monkeypatch.delenv("DDTREE_API_KEY", raising=False)
    keyed = ServerProcess("--api-key", KEY).start(wait=False)
    try:
        assert "authentication on" in keyed.log_text() and KEY not in keyed.log_text()
    finally:
        keyed.stop(signal.SIGKILL)    # SIGTERM would wait for the model load (~8 s) to finish


@pytest.mark.slow
@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", "Bearer ключ".encode(), b"Bearer sk-test-ddtree\xe9"])
def test_real_server_answers_non_ascii_authorization_with_401(api_server, value):
    """Through uvicorn's HTTP parser: obs-text bytes in the header value reach the app as bytes."""
    request = (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + value
               + b"\r\nConnection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", api_server.port), timeout=30) as sock:
        sock.sendall(request)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401"), raw[:300]
    assert b'"code":"invalid_api_key"' in body
