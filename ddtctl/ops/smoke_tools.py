"""Smoke checks of what coding agents use: a tool-call round trip and a json_schema answer.

The conversation has called `get_weather` twice before (OpenAI `tool_calls` and `tool` messages),
so even a 135M model continues the pattern greedily; the check passes when the answer is a
well-formed call (`finish_reason: "tool_calls"`, the function's name, `arguments` a JSON object
naming the city) and the call's result, sent back, gets a text answer. A server that refuses
`tools` fails it with its 4xx.

The json_schema check asks for the capital of France with `response_format: {"type":
"json_schema", ...}` (strict, no other properties): the answer must be one JSON object with the
two required string fields and nothing else (checked here without a schema library: ddtctl stays
small), and the city must be Paris.
"""

from __future__ import annotations

import json
from typing import Any

from ddtctl.ops.checks import CheckFailed, expect

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _called(i: int, city: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"}, _called(1, "Paris"),
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "Weather in Rome?"}, _called(2, "Rome"),
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"}, {"role": "assistant", "content": "Rain."},
    {"role": "user", "content": "Weather in Oslo?"},
]


def tool_round_trip(api: Any, max_tokens: int = 48) -> str:
    """Run the check with `api` (smoke.py's `_Api`); CheckFailed says what was wrong."""

    data = api.ok_json("/v1/chat/completions", {"messages": HISTORY, "tools": [WEATHER], "max_tokens": max_tokens})
    choice = data["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    expect(calls, (f"no tool call (finish_reason {choice.get('finish_reason')!r}): "
                   f"{(message.get('content') or '')[:80]!r}"))
    call = calls[0]
    expect(call["function"]["name"] == "get_weather", f"called {call['function']['name']!r}")
    arguments = json.loads(call["function"]["arguments"])
    expect(isinstance(arguments, dict) and arguments.get("city"), f"arguments {call['function']['arguments']!r}")
    expect(choice["finish_reason"] == "tool_calls", f"finish_reason {choice['finish_reason']!r}")
    result = {"role": "tool", "tool_call_id": call["id"], "content": "snow, -3 C"}
    turn = {"role": "assistant", "content": message.get("content"), "tool_calls": calls}
    answer = api.ok_json("/v1/chat/completions", {"messages": [*HISTORY, turn, result], "tools": [WEATHER],
                                                  "max_tokens": max_tokens})["choices"][0]["message"]
    expect(answer.get("content"), f"no answer after the tool result: {answer}")
    return f"get_weather({arguments['city']}) -> {answer['content'].strip()[:40]!r}"


CAPITAL_SCHEMA = {"type": "object", "properties": {"country": {"type": "string"}, "city": {"type": "string"}},
                  "required": ["country", "city"], "additionalProperties": False}


def json_schema_answer(api: Any, max_tokens: int = 48) -> str:
    """Run the check with `api` (smoke.py's `_Api`); CheckFailed says what was wrong."""

    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL_SCHEMA, "strict": True}}
    text, _ = api.chat([{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
                       max_tokens=max_tokens, response_format=fmt)
    try:
        value = json.loads(text)
    except ValueError:
        raise CheckFailed(f"not JSON: {text[:80]!r}") from None
    expect(isinstance(value, dict) and set(value) == {"country", "city"}, f"not the schema's object: {text[:80]!r}")
    expect(all(isinstance(v, str) for v in value.values()), f"not strings: {text[:80]!r}")
    expect("paris" in value["city"].lower(), f"city {value['city']!r}")
    return text.strip()[:60]
