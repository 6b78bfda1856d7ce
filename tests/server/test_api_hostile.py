"""Hostile request bodies, by class: every answer is an OpenAI-style 2xx/4xx,
never a 5xx, never a hang, and the server still serves afterwards.

Runs the real app, worker and Engine in-process over a random tiny target (tests/server/api_tiny.py)
so that hundreds of requests take seconds. Classes: wrong JSON types for every field, extreme and
non-finite numbers, huge integers, deep nesting, huge strings and bodies, invalid UTF-8, lone
surrogates, duplicate keys, wrong content types, empty bodies, token-id prompts outside the
vocabulary, stop lists of thousands of strings, n out of range, wrong methods and paths.
"""

from __future__ import annotations

import json

import pytest

from tests.server.api_tiny import MAX_MODEL_LEN, TinyApp
from tests.server.tiny import VOCAB

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
BASE = {CHAT: {"messages": USER, "max_tokens": 2}, COMPLETIONS: {"prompt": "hi", "max_tokens": 2}}
JSON_CT = {"content-type": "application/json"}

FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
          "stream_options", "decoding", "ignore_eos", "logprobs", "top_logprobs", "best_of", "tools", "tool_choice",
          "response_format", "logit_bias", "presence_penalty", "frequency_penalty", "messages",
          "chat_template_kwargs", "prompt", "echo", "suffix", "user"]
VALUES = [None, True, False, 0, -1, 1.5, "x", "", [], {}, [1], ["a"], {"a": 1}, 2**64, -(2**63) - 1, 1e308, -1e308,
          5e-324, 1e-39, [[1, 2]], {"mode": "ddtree", "tree_budget": 2}, {"type": "text"}]
NUMBER_LITERALS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "5e-324", "4.9e-324", "1e-45",
                   "1e-39", "-0.0", "-5e-324", "1e308", "2.2250738585072014e-308", "1.7976931348623157e308",
                   "0.9999999999999999", "1.0000000000000002", "9223372036854775807", "9223372036854775808",
                   "-9223372036854775809", "1" * 4000, "1" * 5000]
NUMBER_FIELDS = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "max_tokens",
                 "max_completion_tokens", "n", "best_of", "logprobs", "top_logprobs"]


@pytest.fixture(scope="module")
def tiny():
    app = TinyApp()
    yield app
    app.stop()


def check(response, *, allow: tuple[int, ...] = ()) -> None:
    """2xx with a completion (JSON or a finished SSE stream) or 4xx with the OpenAI error envelope."""
    status = response.status_code
    assert status < 500, f"{status}: {response.text[:500]}"
    ctype = response.headers.get("content-type", "")
    if 200 <= status < 300:
        if ctype.startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n"), response.text[-300:]
            assert '"error"' not in response.text, response.text[-500:]
        else:
            assert ctype.startswith("application/json"), ctype
            assert response.json().get("choices") or response.json().get("data"), response.text[:300]
        return
    assert 400 <= status < 500 or status in allow, status
    assert ctype.startswith("application/json"), (status, ctype, response.text[:200])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error


def post(tiny, path: str, content: bytes, headers: dict | None = None):
    return tiny.request("POST", path, content=content, headers=JSON_CT if headers is None else headers)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("field", FIELDS)
def test_wrong_types_for_every_field(tiny, path, field):
    for value in VALUES:
        check(tiny.request("POST", path, json={**BASE[path], field: value}))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("field", NUMBER_FIELDS + ["decoding.tree_budget"])
def test_extreme_number_literals(tiny, path, field):
    base = json.dumps(BASE[path])[:-1]
    for literal in NUMBER_LITERALS:
        if field == "decoding.tree_budget":
            raw = f'{base}, "decoding": {{"tree_budget": {literal}}}}}'
        else:
            raw = f'{base}, "{field}": {literal}}}'
        check(post(tiny, path, raw.encode()))


@pytest.mark.parametrize("temperature", [5e-324, 1e-45, 1e-39, 1e-30, 9e-6])
@pytest.mark.parametrize("top_p", [1.0, 5e-324, 1e-39])
def test_tiny_temperature_and_top_p_are_greedy(tiny, temperature, top_p):
    """The sampler's underflow class: no 500, and the text is exactly the greedy (T=0) text."""
    body = {"prompt": "hello", "max_tokens": 12, "ignore_eos": True}
    greedy = tiny.request("POST", COMPLETIONS, json={**body, "temperature": 0})
    got = tiny.request("POST", COMPLETIONS, json={**body, "temperature": temperature, "top_p": top_p, "seed": 1})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-39])
def test_tiny_top_p_at_temperature_1_is_top_1(tiny, top_p):
    body = {"prompt": "hello", "max_tokens": 12, "ignore_eos": True}
    greedy = tiny.request("POST", COMPLETIONS, json={**body, "temperature": 0}).json()["choices"][0]["text"]
    for seed in (1, 2):
        got = tiny.request("POST", COMPLETIONS, json={**body, "temperature": 1, "top_p": top_p, "seed": seed})
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == greedy, got.text


@pytest.mark.parametrize("raw", [
    b"[" * 100_000, b"{\"a\":" * 50_000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"prompt": "x", "chat_template_kwargs": ' + b'{"a": ' * 900 + b"1" + b"}" * 900 + b"}",
    b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": ' + b'{"a": ' * 900 + b"1"
    + b"}" * 900 + b"}",
    b'{"prompt": "x", "logprobs": ' + b"[" * 900 + b"]" * 900 + b"}",
    b'{"prompt": "x", "tool_choice": ' + b"[" * 900 + b"]" * 900 + b"}",
])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_deep_nesting(tiny, path, raw):
    check(post(tiny, path, raw))


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"prompt": "a" * 2_000_000}),
    (COMPLETIONS, {"prompt": ["a" * 1_000_000]}),
    (COMPLETIONS, {"prompt": list(range(50)) * 20_000}),
    (CHAT, {"messages": [{"role": "user", "content": "a" * 2_000_000}]}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}] * 20_000}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 20_000}]}),
    (CHAT, {"messages": USER, "model": "m" * 1_000_000}),
    (COMPLETIONS, {"prompt": "hi", "stop": "s" * 1_000_000, "max_tokens": 8}),
    (COMPLETIONS, {"prompt": "hi", "stop": ["a"] * 5000}),
    (COMPLETIONS, {"prompt": "hi", "stop": [str(i) for i in range(16)], "max_tokens": 8}),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"k" * 100_000: "v" * 100_000}}),
    (CHAT, {"messages": USER, "user": "u" * 1_000_000, "max_tokens": 2}),
])
def test_huge_strings_and_lists(tiny, path, body):
    check(tiny.request("POST", path, json=body))


def test_huge_body_is_413_before_it_is_parsed(tiny):
    from ddtree_server.api.middleware import MAX_BODY_BYTES

    assert MAX_BODY_BYTES == 16 << 20
    body = b'{"prompt": "' + b"a" * (40 << 20) + b'"}'
    declared = post(tiny, COMPLETIONS, body)
    check(declared)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    async def chunks():   # no Content-Length: counted as it arrives
        for i in range(0, len(body), 1 << 20):
            yield body[i:i + (1 << 20)]

    chunked = post(tiny, CHAT, chunks())
    check(chunked)
    assert chunked.status_code == 413 and "16777216 bytes" in chunked.json()["error"]["message"]
    just_fits = {"prompt": "a" * ((16 << 20) - 100), "max_tokens": 1}
    assert tiny.request("POST", COMPLETIONS, json=just_fits).status_code == 400   # parsed: context length


@pytest.mark.parametrize("raw", [
    b'{"prompt": "\xff\xfe"}', b"\xff\xfe\xfd", b'{"prompt": "a\xc3"}', b'{"prompt": "\xc0\xaf"}',
    b'{"prompt": "\xed\xa0\x80"}', b'{"messages": [{"role": "user", "content": "\x80"}]}',
    b'{"prompt": "x", "stop": ["\xf5\x80\x80\x80"]}', b"\xef\xbb\xbf" + b'{"prompt": "hi", "max_tokens": 2}',
    '{"prompt": "hi", "max_tokens": 2}'.encode("utf-16"), '{"prompt": "hi", "max_tokens": 2}'.encode("utf-32-le"),
    b'{"prompt": "\x00\x01\x02", "max_tokens": 2}', b'{"prompt": "hi\\u0000", "max_tokens": 2}',
])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_invalid_utf8_and_odd_encodings(tiny, path, raw):
    check(post(tiny, path, raw))


SURROGATE_BODIES = [
    r'{"prompt": "\ud800"}', r'{"prompt": ["\udfff"]}', r'{"prompt": "ok", "stop": "\ud800"}',
    r'{"prompt": "ok", "model": "\ud800"}', r'{"prompt": "ok", "user": "\ud800", "max_tokens": 2}',
    r'{"prompt": "ok", "response_format": {"type": "\ud800"}}', r'{"prompt": "ok", "tool_choice": "\ud800"}',
    r'{"prompt": "ok", "decoding": {"mode": "\ud800"}}', r'{"prompt": "ok", "logit_bias": {"\ud800": 1}}',
    r'{"messages": [{"role": "user", "content": "\ud800"}]}',
    r'{"messages": [{"role": "\ud800", "content": "x"}]}',
    r'{"messages": [{"role": "user", "content": "x", "name": "\udc00"}]}',
    r'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": "\ud800"}, "max_tokens": 2}',
    r'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"\ud800": 1}, "max_tokens": 2}',
    r'{"messages": [{"role": "user", "content": "\ud83d\ude00"}], "max_tokens": 2}',
    r'{"\ud800": 1, "prompt": "ok", "max_tokens": 2}',
]


@pytest.mark.parametrize("raw", SURROGATE_BODIES)
def test_lone_surrogates_anywhere(tiny, raw):
    path = CHAT if '"messages"' in raw else COMPLETIONS
    check(post(tiny, path, raw.encode()))
    check(tiny.request("GET", "/v1/models/%ED%A0%80"))


@pytest.mark.parametrize("raw", [
    b'{"prompt": "a", "prompt": 5}', b'{"prompt": 5, "prompt": "a", "max_tokens": 2}',
    b'{"prompt": "a", "max_tokens": 1, "max_tokens": 100000}', b'{"prompt": "a", "n": 1, "n": 2}',
    b'{"messages": [], "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}',
    b'{"prompt": "a", "decoding": {"tree_budget": 1, "tree_budget": 4096}}',
])
def test_duplicate_keys(tiny, raw):
    check(post(tiny, CHAT if b"messages" in raw else COMPLETIONS, raw))


@pytest.mark.parametrize("ctype", [
    None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/xml",
    "application/json; charset=latin-1", "application/json; charset=utf-16", "application/vnd.api+json",
    "%%%", "application/", "application/json\x00", "", "*/*",
])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_wrong_content_types(tiny, path, ctype):
    headers = {} if ctype is None else {"content-type": ctype}
    check(post(tiny, path, json.dumps(BASE[path]).encode(), headers))
    check(post(tiny, path, b"prompt=hi&max_tokens=2", headers))


@pytest.mark.parametrize("raw", [b"", b" ", b"\n", b"null", b"[]", b"0", b'""', b"{}", b"true", b"[{}]", b"{}{}",
                                 b'{"prompt": "hi"} trailing', b"\x00"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_empty_and_non_object_bodies(tiny, path, raw):
    check(post(tiny, path, raw))
    check(post(tiny, path, raw, {}))


@pytest.mark.parametrize("prompt", [
    [VOCAB], [VOCAB + 1], [10**9], [-1], [-(2**63)], [2**63], [2**64], [1.0], [True], [None], [[1, "a"]], [[]],
    [[1], [2]], [[VOCAB]], [[-5]], [0] * (MAX_MODEL_LEN + 1), list(range(VOCAB)) * 10,
])
def test_token_id_prompts(tiny, prompt):
    check(tiny.request("POST", COMPLETIONS, json={"prompt": prompt, "max_tokens": 2}))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("extra", [
    {"n": 2}, {"n": 10**6}, {"n": 0}, {"n": -1}, {"n": "2"}, {"best_of": 3}, {"n": 2, "stream": True},
    {"stream": True, "stream_options": {"include_usage": "yes"}}, {"stream": True, "stream_options": []},
    {"stream": True, "max_tokens": 3}, {"stream": True, "temperature": 1e-39},
    {"decoding": {"mode": "ddtree", "tree_budget": 4096}}, {"decoding": {"tree_budget": 0}},
    {"decoding": {"mode": "beam"}}, {"decoding": {"extra": 1}}, {"decoding": "ddtree"},
    {"max_tokens": MAX_MODEL_LEN * 100}, {"max_completion_tokens": 2**62},
])
def test_unsupported_or_out_of_range_options(tiny, path, extra):
    check(tiny.request("POST", path, json={**BASE[path], **extra}))


@pytest.mark.parametrize("method, path", [
    ("GET", CHAT), ("PUT", COMPLETIONS), ("DELETE", "/v1/models"), ("POST", "/health"), ("POST", "/ready"),
    ("PATCH", "/metrics"), ("GET", "/v1/models/" + "x" * 60_000), ("GET", "/v1/models/../../etc/passwd"),
    ("GET", "/v1/nothing"), ("POST", "/v1/embeddings"), ("GET", "/v1/models/tiny%00"), ("OPTIONS", CHAT),
])
def test_wrong_methods_and_paths(tiny, method, path):
    response = tiny.request(method, path)
    check(response)
    if response.status_code == 405:
        assert response.headers["allow"] and response.json()["error"]["code"] == "method_not_allowed"


def test_server_still_serves_and_counted_no_5xx(tiny):
    ok = tiny.request("POST", CHAT, json={"messages": USER, "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    metrics = tiny.request("GET", "/metrics").text
    assert 'status="5' not in metrics, [line for line in metrics.splitlines() if 'status="5' in line]


@pytest.mark.parametrize("raw, text", [
    (b'{"prompt": "\xff"}', "invalid UTF-8 at byte 12"), (b'{"prompt": "a\xc3"}', "invalid UTF-8 at byte 13"),
    (b"[" * 100_000, "nested too deeply"),
    (b'{"prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}", "4300 digits"),
])
def test_unparsable_bodies_say_why(tiny, raw, text):
    response = post(tiny, COMPLETIONS, raw)
    check(response)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"the request body is not valid JSON: {text}" or (
        text in response.json()["error"]["message"] and "not valid JSON" in response.json()["error"]["message"])
