"""Fast tests of the API's pure parts: config, request schemas, SSE framing, metrics, sd_notify,
and the app's error shapes while no model is loaded (the worker is not started)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from pydantic import ValidationError

from ddtree_server.api import sdnotify
from ddtree_server.api.app import create_app
from ddtree_server.api.metrics import Metrics
from ddtree_server.api.schemas import ChatCompletionRequest, CompletionRequest
from ddtree_server.api.streaming import DONE, sse
from ddtree_server.api.worker import Worker
from ddtree_server.config import ServerConfig
from tests.server.api_tiny import MODEL_ID, TinyApp


# ---- config ----------------------------------------------------------------------------------

def test_config_defaults_resolve_device_and_dtype():
    cfg = ServerConfig(device="cpu")
    assert (cfg.device, cfg.dtype, cfg.host, cfg.port, cfg.max_queue) == ("cpu", "fp32", "127.0.0.1", 8000, 64)
    assert ServerConfig(device="cuda").dtype == "bf16"
    assert ServerConfig(device="cpu", dtype="bf16").dtype == "bf16"


def test_config_parses_operator_strings():
    cfg = ServerConfig(device="cpu", target_layer_ids="1, 9,17", chat_template_kwargs='{"enable_thinking": false}')
    assert cfg.target_layer_ids == [1, 9, 17]
    assert cfg.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("values", [
    {"target_layer_ids": "a,b"}, {"chat_template_kwargs": "{not json"}, {"chat_template_kwargs": '{"tokenize": 1}'},
    {"tree_budget": 0}, {"mode": "beam"}, {"gguf": "/nonexistent.gguf"}, {"max_concurrency": 0},
])
def test_config_rejects_bad_values(values):
    with pytest.raises(ValidationError):
        ServerConfig(device="cpu", **values)


def test_config_rejects_target_and_gguf_together(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    with pytest.raises(ValidationError, match="not both"):
        ServerConfig(device="cpu", target=tmp_path, gguf=gguf)


# ---- schemas ---------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, expected", [
    ("hi", "hi"), (["hi"], "hi"), ([1, 2], [1, 2]), ([[3, 4]], [3, 4]),
])
def test_completion_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompt == expected


@pytest.mark.parametrize("prompt", [[], "", ["a", "b"], [[1], [2]], [[]], 5, [1.5], [True]])
def test_completion_prompt_rejects(prompt):
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=prompt)


def test_chat_request_fields():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}],
                                stop="x", max_tokens=5, max_completion_tokens=3, decoding={"mode": "ar"})
    assert req.messages[0].text() == "ab" and req.stop == ["x"] and req.token_limit() == 3
    assert req.decoding.mode == "ar" and not req.include_usage()


@pytest.mark.parametrize("body", [
    {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
    {"messages": [{"role": "user", "content": "x"}], "n": 17},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": [{"role": "user", "content": "x"}], "decoding": {"mode": "beam"}},
    {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
    {"messages": [{"role": "user", "content": "x"}], "logprobs": 1},
    {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": False},
    {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0},
])
def test_chat_request_rejects(body):
    with pytest.raises(ValidationError):
        ChatCompletionRequest(**body)


# ---- SSE, metrics, sd_notify -----------------------------------------------------------------

def test_sse_framing():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert DONE == b"data: [DONE]\n\n"


def test_metrics_render_names():
    m = Metrics()
    m.count_request("/v1/completions", 200)
    m.count_request("/random/path", 404)
    m.observe_finished(prompt_tokens=5, stats={"generated_tokens": 7, "mean_acceptance_length": 2.5,
                                               "tokens_per_second": 30.0, "decode_rounds": 2,
                                               "decode_tokens": 5, "decode_seconds": 0.25}, cancelled=True)
    text = m.render().decode()
    assert 'ddtree_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert 'endpoint="other"' in text
    assert "ddtree_generated_tokens_total 7.0" in text
    assert "ddtree_requests_cancelled_total 1.0" in text
    assert "ddtree_acceptance_length_count 1.0" in text
    assert "ddtree_decode_tokens_per_second_count 1.0" in text


def test_metrics_skip_prefill_only_requests_and_count_decode_totals():
    m = Metrics()
    for rounds, tokens, secs in ((0, 0, 0.0001), (4, 10, 0.5), (6, 6, 0.5)):
        m.observe_finished(prompt_tokens=3, stats={
            "generated_tokens": tokens + 1, "decode_rounds": rounds, "decode_tokens": tokens, "decode_seconds": secs,
            "mean_acceptance_length": tokens / rounds if rounds else None,
            "tokens_per_second": tokens / secs if rounds else None})
    text = m.render().decode()
    assert "ddtree_acceptance_length_count 2.0" in text
    assert "ddtree_decode_tokens_per_second_count 2.0" in text
    assert "ddtree_decode_rounds_total 10.0" in text
    assert "ddtree_decode_tokens_total 16.0" in text
    assert "ddtree_decode_seconds_total 1.0" in text
    assert "ddtree_generated_tokens_total 19.0" in text


def test_a_finished_request_is_observed_before_its_answer_is_delivered(monkeypatch):
    """The worker records a finished request (``on_finished``: /metrics' counters) before the
    request's last event and end reach the client, so /metrics read right after a response counts
    it (found by a trial: the counters lagged the answer); a rejected request likewise."""
    from ddtree_server.api import worker as W

    order: list[str] = []
    deliver = W.Job.deliver

    def logged(job, item):
        order.append("end" if item is W._END else "last" if getattr(item, "finish_reason", None) or
                     isinstance(item, BaseException) else "event")
        deliver(job, item)

    def ended() -> list[str]:   # the answer may leave on the last item; the end marker follows it
        deadline = time.monotonic() + 5
        while "end" not in order and time.monotonic() < deadline:
            time.sleep(0.01)
        return order

    monkeypatch.setattr(W.Job, "deliver", logged)
    app = TinyApp(on_finished=lambda job, event: order.append("observed"))
    try:
        ok = app.request("POST", "/v1/completions", json={"model": MODEL_ID, "prompt": "abc", "max_tokens": 5,
                                                         "temperature": 0})
        assert ok.status_code == 200 and ended()
        assert order[-3:] == ["observed", "last", "end"] and order.count("observed") == 1, order
        order.clear()

        def refuse(*args, **kwargs):
            raise ValueError("refused by the engine")
        monkeypatch.setattr(app.engine, "make_request", refuse)
        bad = app.request("POST", "/v1/completions", json={"model": MODEL_ID, "prompt": "abc", "max_tokens": 5})
        assert bad.status_code == 400 and ended() == ["observed", "last", "end"], (bad.text, order)
    finally:
        app.stop()


def test_sdnotify_sends_datagrams(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        sdnotify.on_state("ready", "ready")
        assert sock.recv(1024).decode() == "READY=1\nSTATUS=ready: ready"
        sdnotify.on_state("loading", "loading target")
        assert sock.recv(1024).decode() == "STATUS=loading: loading target"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert sdnotify.notify("READY=1") is False


# ---- the app before the model is loaded --------------------------------------------------------

def _request(method: str, path: str, api_key: str | None = None, **kwargs) -> httpx.Response:
    config = ServerConfig(device="cpu", api_key=api_key)
    worker = Worker(load=lambda status: None, warmup=lambda engine: None)   # never started
    app = create_app(config, worker, Metrics())

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_models_show_folder_names_not_paths(tmp_path):
    """/v1/models names the drafter (and target) by folder name only, on a real tiny Engine."""
    from ddtree_server.engine.engine import Engine
    from tests.server.tiny import EOS, VOCAB, ByteTokenizer, TableDrafter, tiny_target

    drafter_dir, target_dir = tmp_path / "secret" / "my-drafter", tmp_path / "secret" / "my-target"
    drafter_dir.mkdir(parents=True)
    target_dir.mkdir()
    engine = Engine(tiny_target(), ByteTokenizer(), TableDrafter([[1]], vocab=VOCAB, hidden=64, layer_ids=[1, 2]),
                    eos_token_ids=[EOS], max_model_len=64, model_id="tiny")
    config = ServerConfig(device="cpu", drafter=drafter_dir, target=target_dir)
    worker = Worker(load=lambda status: engine, warmup=lambda engine: None)
    worker.start()
    try:
        for _ in range(100):
            if worker.state == "ready":
                break
            time.sleep(0.05)
        app = create_app(config, worker, Metrics())

        async def go() -> httpx.Response:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.get("/v1/models")

        response = asyncio.run(go())
    finally:
        worker.stop()
    assert response.status_code == 200, response.text
    card = response.json()["data"][0]
    assert card["drafter"] == "my-drafter" and card["target"] == "my-target"
    assert str(tmp_path) not in response.text and "secret" not in response.text


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_ready_reports_loading_and_models_503():
    response = _request("GET", "/ready")
    assert response.status_code == 503
    assert response.json()["state"] == "loading" and "elapsed_s" in response.json()
    assert _request("GET", "/v1/models").status_code == 503
    assert _request("GET", "/health").status_code == 503   # worker thread not running


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": 99999999999999999999999}, "seed"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": 2**63}, "seed"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": -(2**63) - 1}, "seed"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [1, 2]}, "stop"),
])
def test_validation_errors_are_openai_400(body, param):
    response = _request("POST", "/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = _error(response)
    assert error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
                                 b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}'])
def test_non_finite_sampling_values_are_400(raw):
    response = _request("POST", "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["param"] in ("temperature", "top_p") and "finite" in error["message"]


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "a\ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}',
     "messages.0.content"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "x"}], "stop": ["\ud800"]}', "stop"),
    ("/v1/completions", r'{"prompt": "\ud800"}', "prompt"),
    ("/v1/completions", r'{"prompt": ["\ud800x"]}', "prompt"),
])
def test_lone_surrogates_are_400(path, raw, param):
    response = _request("POST", path, content=raw.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert "surrogate" in error["message"]


_U = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("path, extra, param, unsupported", [
    ("/v1/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", False),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", False),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", False),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name", False),
    ("/v1/chat/completions", {"frequency_penalty": False}, "frequency_penalty", False),
    ("/v1/chat/completions", {"temperature": True}, "temperature", False),
    ("/v1/chat/completions", {"response_format": {"type": "grammar"}}, "response_format", False),
    ("/v1/chat/completions", {"logit_bias": {"a": -100}}, "logit_bias", False),
    ("/v1/chat/completions", {"logit_bias": {"5": -101}}, "logit_bias", False),
    ("/v1/completions", {"logprobs": 21}, "logprobs", False),
    ("/v1/chat/completions", {"frequency_penalty": 3}, "frequency_penalty", False),
    ("/v1/completions", {"presence_penalty": -2.5}, "presence_penalty", False),
    ("/v1/completions", {"best_of": 2}, "best_of", True),
    ("/v1/completions", {"stream": "yes"}, "stream", False),
    ("/v1/chat/completions", {"stream": "true"}, "stream", False),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0.content", False),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content", False),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "messages.0.content.0.type", False),
])
def test_unsupported_openai_params_are_400(path, extra, param, unsupported):
    body = {"messages": _U} if path.endswith("chat/completions") else {"prompt": "x"}
    response = _request("POST", path, json={**body, **extra})
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if unsupported:
        assert "not supported by this server" in error["message"]


def test_neutral_values_of_unsupported_params_are_accepted():
    request = ChatCompletionRequest(messages=_U, tools=[], tool_choice="none", response_format={"type": "text"},
                                    logit_bias={}, presence_penalty=0, frequency_penalty=0.0, stream=False)
    assert request.stream is False
    assert CompletionRequest(prompt="x", best_of=1, stream=None).stream is False
    assert ChatCompletionRequest(messages=[*_U, {"role": "assistant", "content": None}]).messages[1].text() == ""


def test_seed_range_is_int64():
    for seed in (0, -1, -(2**63), 2**63 - 1):
        assert CompletionRequest(prompt="x", seed=seed).seed == seed
    import torch

    from ddtree_server.engine.sampling import SamplingParams, TokenChooser
    for seed in (-(2**63), 2**63 - 1):   # the engine's generator takes every accepted seed
        TokenChooser(SamplingParams(max_tokens=1, temperature=1.0, seed=seed), torch.device("cpu"))


def test_malformed_json_is_400():
    response = _request("POST", "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "malformed JSON" in _error(response)["message"]


def test_api_key_guards_v1_only():
    assert _request("GET", "/v1/models", api_key="k").status_code == 401
    assert _error(_request("POST", "/v1/completions", api_key="k", json={}))["code"] == "invalid_api_key"
    assert _request("GET", "/v1/models", api_key="k", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert _request("GET", "/v1/models", api_key="k", headers={"Authorization": "Bearer k"}).status_code == 503
    assert _request("GET", "/ready", api_key="k").status_code == 503
    assert _request("GET", "/metrics", api_key="k").status_code == 200


def test_unknown_route_is_openai_404():
    response = _request("GET", "/v1/nothing")
    assert response.status_code == 404 and _error(response)["code"] == "not_found"


# ---- the SSE chunk sequence over real engine event objects --------------------------------------

def _collect(shape, events, fail_after: int | None = None) -> list[bytes]:
    from ddtree_server.api.streaming import event_stream

    closed = []

    async def go() -> list[bytes]:
        pending = list(events[1:])

        async def next_event():
            if fail_after is not None and len(events) - len(pending) > fail_after:
                raise RuntimeError("device lost")
            return pending.pop(0) if pending else None

        return [chunk async for chunk in event_stream(shape, events[0], next_event, prompt_tokens=3,
                                                      on_close=closed.append)]

    out = asyncio.run(go())
    assert closed == [True]
    return out


def _events():
    from ddtree_server.engine.engine import DecodeStats, GenerationEvent

    stats = DecodeStats(mode="ar", tree_budget=None, block_size=None, decode_rounds=2, generated_tokens=3,
                        mean_acceptance_length=1.0, prefill_seconds=0.1, decode_seconds=0.2, tokens_per_second=15.0)
    return [GenerationEvent([5], "Hel", None, None), GenerationEvent([6], "lo", None, None),
            GenerationEvent([7], "!", "stop", stats)]


def test_chat_stream_sequence_with_usage():
    from ddtree_server.api.streaming import ChunkShape

    raw = _collect(ChunkShape("chat", "chatcmpl-1", 1, "m", include_usage=True), _events())
    assert raw[-1] == DONE
    chunks = [json.loads(c[len(b"data: "):]) for c in raw[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:4]] == ["Hel", "lo", "!"]
    assert chunks[3]["choices"][0]["finish_reason"] == "stop" and chunks[3]["decoding"]["mode"] == "ar"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3,
                                                                   "total_tokens": 6}


def test_completion_stream_error_mid_stream_still_ends_with_done():
    from ddtree_server.api.streaming import ChunkShape

    raw = _collect(ChunkShape("completion", "cmpl-1", 1, "m", include_usage=False), _events(), fail_after=1)
    assert raw[-1] == DONE
    chunks = [json.loads(c[len(b"data: "):]) for c in raw[:-1]]
    assert chunks[0]["choices"][0]["text"] == "Hel" and "usage" not in chunks[0]
    assert chunks[-1]["error"]["type"] == "server_error" and "device lost" in chunks[-1]["error"]["message"]


@pytest.mark.parametrize("raw, headers, expected", [
    (b"", {"content-type": "application/json"}, "the request body is empty"),
    (b"", {}, "the request body is empty"),
    (b"[]", {"content-type": "application/json"}, "the request body must be a JSON object"),
    (b'{"prompt": "hi"}', {"content-type": "text/plain"}, "Content-Type: application/json"),
    (b'{"prompt": "hi"}', {"content-type": "application/x-www-form-urlencoded"}, "Content-Type: application/json"),
])
def test_missing_or_non_object_body_says_so(raw, headers, expected):
    """An empty body, a JSON array or a JSON body sent with another Content-Type (curl -d without
    -H) get a 400 that says what is wrong (was "missing required field None" / pydantic's
    "Input should be a valid dictionary or object to extract fields from")."""
    response = _request("POST", "/v1/completions", content=raw, headers=headers)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["type"] == "invalid_request_error" and error["param"] is None, error
    assert expected in error["message"] and "None" not in error["message"], error


def test_metrics_of_the_speculation_policy():
    from ddtree_server.engine.batch import StepInfo

    m = Metrics()
    m.observe_step(StepInfo("decode", 3, 9, 0.01, nodes=40, kinds={"plain": 1, "chain": 0, "tree": 2}))
    m.observe_step(StepInfo("decode", 3, 3, 0.01, nodes=0, kinds={"plain": 3, "chain": 0, "tree": 0}))
    m.observe_finished(prompt_tokens=3, stats={"generated_tokens": 9, "decode_rounds": 4, "decode_tokens": 10,
                                               "decode_seconds": 0.1, "mean_tree_nodes": 12.5})
    text = m.render().decode()
    assert "ddtree_round_draft_nodes_count 2.0" in text and "ddtree_round_draft_nodes_sum 40.0" in text
    assert "ddtree_last_round_draft_nodes 0.0" in text
    assert 'ddtree_request_rounds_total{kind="plain"} 4.0' in text
    assert 'ddtree_request_rounds_total{kind="tree"} 2.0' in text
    assert "ddtree_verified_draft_nodes_total 50.0" in text and "ddtree_accepted_draft_tokens_total 6.0" in text


def test_a_burst_fills_free_slots_before_the_queue_limit():
    """Jobs that free engine slots take at the next step boundary do not count against
    --max-queue: with 3 free slots and max_queue 2, five jobs arriving during one step are
    accepted and the sixth is 429 (QueueFull); one slot taken by a running job lowers that by one."""
    from ddtree_server.api.worker import Job, QueueFull

    async def burst(running: int) -> int:
        worker = Worker(load=lambda status: None, warmup=lambda engine: None, max_queue=2, max_concurrency=3)
        worker.state, worker._running = "ready", running   # as after loading, `running` jobs in the engine
        accepted = 0
        for i in range(10):
            try:
                worker.submit(Job(rid=f"r{i}", prompt_ids=[1], params=None))
            except QueueFull:
                break
            accepted += 1
        return accepted

    assert asyncio.run(burst(0)) == 5
    assert asyncio.run(burst(1)) == 4
    assert asyncio.run(burst(3)) == 2
