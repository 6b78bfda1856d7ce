"""End-to-end with the official `openai` client against the real server (SmolLM2, CPU, fp32):
response_format json_schema, logprobs (plain and streamed) and penalties, equal across modes."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.serverproc import MODEL

pytest_plugins = ["tests.server.api_fixtures"]
pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "country": {"type": "string", "maxLength": 30},
    "population_millions": {"type": "number", "minimum": 0, "maximum": 50}},
    "required": ["city", "country", "population_millions"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give the capital of France and its population as JSON."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA, "strict": True}}


def test_json_schema_with_logprobs_equal_across_modes(api_client):
    outs = {}
    for mode in ("ar", "ddtree"):
        resp = api_client.chat.completions.create(
            model=MODEL, messages=ASK, temperature=0, max_tokens=60, response_format=FORMAT,
            logprobs=True, top_logprobs=2, extra_body={"decoding": {"mode": mode}})
        choice = resp.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        content = choice.logprobs.content
        assert len(content) == resp.usage.completion_tokens
        assert "".join(t.token for t in content) == choice.message.content
        for t in content:
            assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
        outs[mode] = (choice.message.content, [t.logprob for t in content])
    assert outs["ar"][0] == outs["ddtree"][0]
    assert max(abs(a - b) for a, b in zip(outs["ar"][1], outs["ddtree"][1])) < 1e-4


def test_streamed_logprobs_and_penalties(api_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colours."}], temperature=0,
                  max_tokens=24, logprobs=True, top_logprobs=1, frequency_penalty=1.0, presence_penalty=0.5,
                  logit_bias={"28": -5})
    whole = api_client.chat.completions.create(**kwargs)
    chunks = api_client.chat.completions.create(stream=True, **kwargs)
    tokens, text = [], ""
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            tokens += [t.token for t in (choice.logprobs.content if choice.logprobs else None) or []]
    assert text == whole.choices[0].message.content
    assert tokens == [t.token for t in whole.choices[0].logprobs.content]


def test_completion_logprobs_and_refused_schema(api_client):
    resp = api_client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                         temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 8 and all(len(t) == 3 for t in lp.top_logprobs)
    with pytest.raises(openai.BadRequestError) as err:
        api_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert "not a valid JSON Schema" in str(err.value)
