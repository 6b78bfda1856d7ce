"""End-to-end: every client mistake is an OpenAI-style 4xx decided before any stream byte."""

from __future__ import annotations

import openai
import pytest

from tests.server.serverproc import MAX_MODEL_LEN, MODEL

pytest_plugins = ["tests.server.api_fixtures"]
pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Hello"}]


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": USER, "n": 17}, "n"),
    ({"messages": USER, "temperature": -1}, "temperature"),
    ({"messages": USER, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"messages": USER, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
])
def test_chat_client_errors_are_400(api_http, body, param, stream):
    error = error_of(api_http.post("/v1/chat/completions", json={"model": MODEL, "stream": stream, **body}), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_context_overflow_names_the_numbers(api_http):
    prompt = [42] * (MAX_MODEL_LEN - 10)
    error = error_of(api_http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 20,
                                                            "stream": True}), 400)
    assert str(MAX_MODEL_LEN - 10) in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    assert "20" in error["message"] and error["code"] == "context_length_exceeded"
    error = error_of(api_http.post("/v1/completions", json={"model": MODEL, "prompt": [42] * MAX_MODEL_LEN}), 400)
    assert error["code"] == "context_length_exceeded"
    # a max_tokens the client never sent is named as the endpoint's default (16 on /v1/completions)
    error = error_of(api_http.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), 400)
    assert "max_tokens (16, the default)" in error["message"], error
    assert "the default" not in error_of(api_http.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 16}), 400)["message"]


@pytest.mark.parametrize("prompt", [[10**9], [-1], [[5, 49152]]])
def test_token_ids_outside_vocabulary(api_http, prompt):
    error = error_of(api_http.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), 400)
    assert error["param"] == "prompt" and "vocabulary" in error["message"]


@pytest.mark.parametrize("prompt", ["", [], ["a", "b"], 7])
def test_bad_prompts(api_http, prompt):
    error_of(api_http.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), 400)


def test_unknown_model_is_404(api_http, api_client):
    error = error_of(api_http.post("/v1/chat/completions", json={"model": "gpt-nope", "messages": USER}), 404)
    assert error["code"] == "model_not_found"
    error_of(api_http.get("/v1/models/gpt-nope"), 404)
    with pytest.raises(openai.NotFoundError):
        api_client.completions.create(model="gpt-nope", prompt="x", max_tokens=1)


def test_malformed_json_and_wrong_body(api_http):
    headers = {"content-type": "application/json"}
    error = error_of(api_http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [', headers=headers), 400)
    assert "malformed JSON" in error["message"]
    error_of(api_http.post("/v1/chat/completions", content=b"[1, 2]", headers=headers), 400)
    error_of(api_http.post("/v1/completions", json={"model": MODEL}), 400)


def test_openai_client_sees_bad_request(api_client):
    with pytest.raises(openai.BadRequestError) as info:
        api_client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert info.value.status_code == 400 and info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        api_client.chat.completions.create(model=MODEL, messages=USER, max_tokens=0, stream=True)


def test_chat_template_error_is_400(api_tokenizer):
    """A template that raises (like Mistral's "roles must alternate") gives 400, not 500."""
    from ddtree_server.api.prompts import chat_prompt_ids
    from ddtree_server.api.responses import ApiError
    from ddtree_server.api.schemas import ChatCompletionRequest

    tokenizer = api_tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    try:
        with pytest.raises(ApiError) as info:
            chat_prompt_ids(tokenizer, ChatCompletionRequest(messages=USER), {})
    finally:
        tokenizer.chat_template = original
    assert info.value.status == 400 and "alternate" in info.value.message
    ids = chat_prompt_ids(tokenizer, ChatCompletionRequest(messages=[{"role": "developer", "content": "Be brief."},
                                                                     *USER]), {})
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.") and text.endswith("<|im_start|>assistant\n")


def test_chat_template_kwargs_reach_the_template(api_tokenizer):
    """Server defaults (--chat-template-kwargs) merged with the request's, request wins."""
    from ddtree_server.api.prompts import chat_prompt_ids
    from ddtree_server.api.schemas import ChatCompletionRequest

    tokenizer = api_tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if enable_thinking is defined and not enable_thinking %} NOTHINK{% endif %}"
                               "{% if style is defined %} {{ style }}{% endif %}")
    try:
        def render(request_kwargs, defaults):
            request = ChatCompletionRequest(messages=USER, chat_template_kwargs=request_kwargs)
            return tokenizer.decode(chat_prompt_ids(tokenizer, request, defaults))

        assert render(None, {}) == "Hello"
        assert render({"enable_thinking": False}, {}) == "Hello NOTHINK"
        assert render(None, {"enable_thinking": False, "style": "terse"}) == "Hello NOTHINK terse"
        assert render({"enable_thinking": True}, {"enable_thinking": False}) == "Hello"
    finally:
        tokenizer.chat_template = original
