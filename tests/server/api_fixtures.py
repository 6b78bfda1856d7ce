"""Session fixtures of the API end-to-end tests (loaded with `pytest_plugins` by test_api_*.py).

ONE real server process per test session (SmolLM2, fp32, CPU) with an API key, a served model
name, a small context window and a `$NOTIFY_SOCKET` that records the sd_notify datagrams. Tests
that need other flags (drain, queue limits) start their own `ServerProcess`.
"""

from __future__ import annotations

import socket
import threading

import httpx
import openai
import pytest

from tests.server.serverproc import API_KEY, MAX_MODEL_LEN, MODEL, ServerProcess


class NotifyListener:
    """A systemd-style notification socket (AF_UNIX datagrams) collecting every message."""

    def __init__(self, path: str) -> None:
        self.path, self.messages = path, []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except socket.timeout:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture(scope="session")
def api_notify(tmp_path_factory) -> NotifyListener:
    listener = NotifyListener(str(tmp_path_factory.mktemp("notify") / "sock"))
    yield listener
    listener.close()


@pytest.fixture(scope="session")
def api_server(api_notify) -> ServerProcess:
    """The shared server: --api-key, --served-model-name smol-test, --max-model-len 1024."""
    server = ServerProcess("--api-key", API_KEY, "--served-model-name", MODEL,
                           "--max-model-len", str(MAX_MODEL_LEN), env={"NOTIFY_SOCKET": api_notify.path})
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def api_client(api_server) -> openai.OpenAI:
    """The official OpenAI client pointed at the shared server (no retries: errors surface)."""
    return openai.OpenAI(base_url=api_server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def api_tokenizer():
    """The real SmolLM2 tokenizer, read from the converted default GGUF (as the server reads it)."""
    from transformers import AutoTokenizer

    from ddtree_server.models.default import default_gguf_path
    from ddtree_server.models.load import gguf_to_folder

    return AutoTokenizer.from_pretrained(gguf_to_folder(default_gguf_path()))


@pytest.fixture(scope="session")
def api_http(api_server) -> httpx.Client:
    """A raw httpx client with the API key, for exact status codes and bodies."""
    with httpx.Client(base_url=api_server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=300) as client:
        yield client
