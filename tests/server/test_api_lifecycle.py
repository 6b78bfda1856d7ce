"""End-to-end: concurrent clients, disconnect cancellation, queue limit (429), SIGTERM drain."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.serverproc import API_KEY, MODEL, THREAD_ENV, ServerProcess

pytest_plugins = ["tests.server.api_fixtures"]
pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):", "Water boils at"]
LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.url("/metrics"), timeout=30).text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_concurrent_clients_get_their_own_answers(api_client):
    def one(prompt: str) -> str:
        return api_client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

    sequential = [one(p) for p in PROMPTS]
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(one, PROMPTS))
    assert concurrent == sequential


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_generation(api_server, stream):
    before = metric(api_server, "ddtree_requests_cancelled_total")
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "stream": stream, **LONG}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if stream:
        with httpx.stream("POST", api_server.url("/v1/completions"), json=body, headers=headers, timeout=60) as resp:
            assert resp.status_code == 200
            next(resp.iter_lines())   # the generation is running; now hang up
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(api_server.url("/v1/completions"), json=body, headers=headers, timeout=1.5)
    wait_for(lambda: metric(api_server, "ddtree_requests_cancelled_total") > before, 60, "cancellation metric")
    assert "cancelled" in api_server.log_text()
    wait_for(lambda: metric(api_server, "ddtree_running_requests") == 0, 30, "the worker to be idle")


def test_queue_limit_and_sigterm_drain():
    """--max-queue 0 --max-running 1: a second request while one runs is 429. SIGTERM while a
    stream is in flight: /ready says draining, new requests get 503, the stream completes in full,
    the process exits 0."""
    server = ServerProcess("--max-queue", "0", "--max-running", "1").start()
    try:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=600)
        stream = client.completions.create(model=client.models.list().data[0].id, prompt="Count: 1, 2, 3,",
                                           max_tokens=100, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        received = [next(chunks)]   # the generation is running on the worker

        busy = httpx.post(server.url("/v1/completions"), json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"

        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(server.url("/ready"), timeout=10).json()["state"] == "draining", 30, "draining")
        ready = httpx.get(server.url("/ready"), timeout=10)
        assert ready.status_code == 503 and ready.json()["state"] == "draining"
        refused = httpx.post(server.url("/v1/completions"), json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"

        received += list(chunks)
        assert [c.choices[0].finish_reason for c in received if c.choices][-1] == "length"
        assert received[-1].usage.completion_tokens == 100
        assert server.proc.wait(120) == 0, server.log_tail()
    finally:
        server.stop(signal.SIGKILL)


def test_second_sigterm_exits_at_once_without_aborting():
    """A second SIGTERM while a generation runs exits at once with the status the log names, not
    by SIGABRT ("terminate called without an active exception": the interpreter was finalised
    while the worker thread was inside torch)."""
    server = ServerProcess("--drain-timeout", "300").start()
    try:
        stream = httpx.stream("POST", server.url("/v1/completions"), timeout=60,
                              json={"prompt": "Count: 1, 2, 3,", "stream": True, **LONG})
        with stream as response:
            lines = response.iter_lines()   # kept: a dropped iterator closes the stream (a disconnect)
            next(lines)                     # the generation is running on the worker
            server.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: "draining" in server.log_text(), 30, "draining")
            server.proc.send_signal(signal.SIGTERM)
            status = server.proc.wait(30)
        assert status == 0, server.log_tail()
        assert "terminate called" not in server.log_text() and "exiting with status 0" in server.log_text()
    finally:
        server.stop(signal.SIGKILL)


def test_drain_deadline_passed_exits_without_aborting():
    """SIGTERM with --drain-timeout 1 while a long generation runs (--max-running 1) and six clients
    wait in the queue (three streaming): the drain gives up, the stream ends with finish_reason
    "cancelled" and [DONE], each queued request gets 503 + Retry-After (it never started), nothing
    gets a 500, and the process exits 0, not by SIGABRT with the worker thread still inside torch.
    (One server for both: the drain deadline is the same path for the running and queued ones.)"""
    server = ServerProcess("--drain-timeout", "1", "--max-running", "1").start()
    answers: list = [None] * 6

    def queued(i: int) -> None:
        body = {"prompt": f"Item {i}:", "max_tokens": 4, "stream": i % 2 == 0}
        answers[i] = httpx.post(server.url("/v1/completions"), json=body, timeout=120)

    try:
        stream = httpx.stream("POST", server.url("/v1/completions"), timeout=120,
                              json={"prompt": "Count: 1, 2, 3,", "stream": True, **LONG, "max_tokens": 8000})
        with stream as response:
            lines = response.iter_lines()   # kept: a dropped iterator closes the stream (a disconnect)
            next(lines)                     # the generation is running on the worker
            clients = [threading.Thread(target=queued, args=(i,)) for i in range(6)]
            for client in clients:
                client.start()
            wait_for(lambda: httpx.get(server.url("/health"), timeout=30).json()["queued"] >= 6, 60,
                     "the six requests to queue")
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            rest = [x for x in lines if x]  # the stream ends properly: cancelled at the drain deadline
            for client in clients:
                client.join(120)
            status = server.proc.wait(120)
            seconds = time.monotonic() - t0
        assert status == 0, server.log_tail()
        assert rest[-1] == "data: [DONE]" and any('"finish_reason":"cancelled"' in x.replace(" ", "") for x in rest), rest[-3:]
        assert seconds < 25, seconds        # not uvicorn's 30 s graceful wait for an unfinished response
        codes = [a.status_code for a in answers]
        assert codes == [503] * 6, [(a.status_code, a.text[:200]) for a in answers]
        for a in answers:
            assert a.headers.get("retry-after") and a.json()["error"]["type"] == "service_unavailable"
            assert "cancelled before it started" in a.json()["error"]["message"]
        log = server.log_text()
        assert "drain timeout" in log and "terminate called" not in log and "exiting with status 0" in log
        assert "the generation produced no result" not in log
    finally:
        server.stop(signal.SIGKILL)


def test_model_load_failure_exits_1(tmp_path):
    """A target that cannot load: /ready says failed (or the process is already gone), exit 1."""
    server = ServerProcess("--target", str(tmp_path)).start(wait=False)
    try:
        assert server.proc.wait(300) == 1, server.log_tail()
        assert "state failed" in server.log_text()
    finally:
        server.stop(signal.SIGKILL)


def _serve_exit(*args: str) -> subprocess.CompletedProcess:
    import os
    import sys

    device = [] if "--device" in args else ["--device", "cpu", "--dtype", "fp32"]
    argv = [sys.executable, "-m", "ddtree_server", "serve", *device, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **THREAD_ENV})


def test_busy_port_or_bad_host_exits_1_before_loading():
    """A port in use / an unresolvable host: one error line and exit 1 at once (never SIGABRT)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        done = _serve_exit("--host", "127.0.0.1", "--port", str(port))
        assert done.returncode == 1, done.stderr[-3000:]
        assert time.monotonic() - started < 30
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert errors == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"], done.stderr
        assert "loading" not in done.stderr and "Traceback" not in done.stderr
    done = _serve_exit("--host", "999.1.1.1", "--port", "8000")
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.startswith("error: cannot listen on 999.1.1.1:8000:"), done.stderr
    assert "Traceback" not in done.stderr


def test_device_cuda_without_cuda_exits_1_at_once():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    started = time.monotonic()
    done = _serve_exit("--device", "cuda", "--port", "0")
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip() == "error: --device cuda: CUDA is not available on this machine (use --device cpu)"
    assert time.monotonic() - started < 60


def test_unusable_drafter_for_spec_mode_is_one_error_line(tmp_path):
    """--mode dflash with a drafter folder that cannot load: exit 1, one error line, no traceback."""
    done = _serve_exit("--mode", "dflash", "--drafter", str(tmp_path), "--host", "127.0.0.1", "--port", "0")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not be served" in errors[0], done.stderr[-3000:]


def test_server_turns_on_expandable_segments_unless_the_operator_chose():
    """The CUDA allocator's expandable segments are the server's default (a full 27B server lost
    2.2 GiB to fragmentation without them); an operator's own PYTORCH_CUDA_ALLOC_CONF stays."""
    import os
    from types import SimpleNamespace

    from ddtree_server.commands.serve import ALLOC_CONF_ENV, run_server

    config = SimpleNamespace(device="cpu", host="999.1.1.1", port=8000)   # fails to bind: returns at once
    saved = os.environ.pop(ALLOC_CONF_ENV, None)
    try:
        assert run_server(config) == 1
        assert os.environ[ALLOC_CONF_ENV] == "expandable_segments:True"
        os.environ[ALLOC_CONF_ENV] = "max_split_size_mb:512"
        assert run_server(config) == 1
        assert os.environ[ALLOC_CONF_ENV] == "max_split_size_mb:512"
    finally:
        os.environ.pop(ALLOC_CONF_ENV, None)
        if saved is not None:
            os.environ[ALLOC_CONF_ENV] = saved
