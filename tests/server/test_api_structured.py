"""The API's response_format, logprobs and penalties over the real app and a real tiny Engine
(in-process, tests/server/api_tiny.py): shapes, exactness across modes, hostile schemas."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from tests.server.api_tiny import TinyApp, tiny_engine
from tests.server.tiny import TableDrafter, VOCAB

# ASCII strings: the byte tokenizer's incremental detokenisation garbles split UTF-8 characters
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{3,12}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]}
CHAT = [{"role": "user", "content": "json"}]


@pytest.fixture(scope="module")
def app():
    drafter = TableDrafter([[ord('"'), ord("a")], [ord("a"), ord(",")], [ord(" ")]], vocab=VOCAB, hidden=64,
                           layer_ids=[1, 2])
    tiny = TinyApp(tiny_engine(drafter, tree_budget=8))
    yield tiny
    tiny.stop()


def _chat(app, **extra):
    body = {"messages": CHAT, "temperature": 0, "max_tokens": 70, **extra}
    resp = app.request("POST", "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}


def test_json_schema_output_validates_and_modes_agree(app):
    outs = {}
    for mode in ("ar", "dflash", "ddtree"):
        body = _chat(app, response_format=_schema_format(SCHEMA), decoding={"mode": mode})
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", body
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        outs[mode] = choice["message"]["content"]
    assert outs["ar"] == outs["dflash"] == outs["ddtree"]


def test_json_object(app):
    body = _chat(app, response_format={"type": "json_object"}, max_tokens=40)
    content = body["choices"][0]["message"]["content"]
    assert content.startswith("{")
    if body["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)


def test_chat_logprobs_shape_and_stream(app):
    body = _chat(app, logprobs=True, top_logprobs=3, max_tokens=24, presence_penalty=0.5)
    lp = body["choices"][0]["logprobs"]["content"]
    assert len(lp) == body["usage"]["completion_tokens"]
    for entry in lp:
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry["top_logprobs"][0]["token"] == entry["token"] and values[0] == entry["logprob"]
        assert bytes(entry["bytes"]).decode("utf-8", "backslashreplace") == entry["token"]   # pieces: \\xNN
    streamed = []
    with_stream = {"messages": CHAT, "temperature": 0, "max_tokens": 24, "stream": True, "logprobs": True,
                   "top_logprobs": 3, "presence_penalty": 0.5}
    resp = app.request("POST", "/v1/chat/completions", json=with_stream)
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                streamed += (choice.get("logprobs") or {}).get("content") or []
    assert [e["token"] for e in streamed] == [e["token"] for e in lp]
    assert [e["logprob"] for e in streamed] == [e["logprob"] for e in lp]


def test_completion_logprobs(app):
    resp = app.request("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 12, "temperature": 0,
                                                       "logprobs": 2, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 12
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert all(len(top) <= 2 for top in lp["top_logprobs"])


def test_penalties_and_bias_change_output_and_agree_across_modes(app):
    plain = _chat(app, max_tokens=40, ignore_eos=True)["choices"][0]["message"]["content"]
    knobs = dict(frequency_penalty=1.5, repetition_penalty=1.5, logit_bias={str(ord("e")): 5})
    outs = {m: _chat(app, max_tokens=40, ignore_eos=True, decoding={"mode": m}, **knobs)
            ["choices"][0]["message"]["content"] for m in ("ar", "dflash", "ddtree")}
    assert outs["ar"] != plain and outs["ar"] == outs["dflash"] == outs["ddtree"]


def _deep(n):
    schema = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("schema, needle", [
    ({"type": "foo"}, "not a valid JSON Schema"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "cannot compile"),
    ({"type": "string", "pattern": "(a"}, "is not a 'regex'"),
    ({"type": "string", "pattern": "(?<=a)b"}, "cannot compile"),
    ({"type": "integer", "minimum": 1e30}, "cannot compile"),   # xgrammar's failed C++ check, no source path
    (_deep(60), "nests deeper"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}, "properties"),
    ({"enum": ["x" * 1000] * 40}, "bytes of JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_hostile_schemas_are_400_in_bounded_time(app, schema, needle):
    t0 = time.monotonic()
    body = {"messages": CHAT, "response_format": _schema_format(schema)}
    resp = app.request("POST", "/v1/chat/completions", json=body)
    assert time.monotonic() - t0 < 10
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert needle in error["message"] and error["param"].startswith("response_format"), error
    assert ".cc:" not in error["message"] and "Check failed" not in error["message"], error


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "response_format.json_schema.strict"),
])
def test_malformed_response_formats(app, fmt, param):
    resp = app.request("POST", "/v1/chat/completions", json={"messages": CHAT, "response_format": fmt})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_logit_bias_outside_vocabulary_and_top_logprobs_alone(app):
    resp = app.request("POST", "/v1/chat/completions", json={"messages": CHAT, "logit_bias": {"100000": 1}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logit_bias"
    resp = app.request("POST", "/v1/chat/completions", json={"messages": CHAT, "top_logprobs": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_logprobs"
