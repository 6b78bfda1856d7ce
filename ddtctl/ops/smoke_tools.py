"""Smoke check of function calling: a tool-call round trip over the OpenAI API.

The conversation has called `get_weather` twice before (OpenAI `tool_calls` and `tool` messages),
so even a 135M model continues the pattern greedily; the check passes when the answer is a
well-formed call (`finish_reason: "tool_calls"`, the function's name, `arguments` a JSON object
naming the city) and the call's result, sent back, gets a text answer. A server that refuses
`tools` fails it with its 4xx.
"""

from __future__ import annotations

import json
from typing import Any

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
    """Run the check with `api` (smoke.py's `_Api`); AssertionError says what was wrong."""
    data = api.ok_json("/v1/chat/completions", {"messages": HISTORY, "tools": [WEATHER], "max_tokens": max_tokens})
    choice = data["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    assert calls, (f"no tool call (finish_reason {choice.get('finish_reason')!r}): "
                   f"{(message.get('content') or '')[:80]!r}")
    call = calls[0]
    assert call["function"]["name"] == "get_weather", f"called {call['function']['name']!r}"
    arguments = json.loads(call["function"]["arguments"])
    assert isinstance(arguments, dict) and arguments.get("city"), f"arguments {call['function']['arguments']!r}"
    assert choice["finish_reason"] == "tool_calls", f"finish_reason {choice['finish_reason']!r}"
    result = {"role": "tool", "tool_call_id": call["id"], "content": "snow, -3 C"}
    turn = {"role": "assistant", "content": message.get("content"), "tool_calls": calls}
    answer = api.ok_json("/v1/chat/completions", {"messages": [*HISTORY, turn, result], "tools": [WEATHER],
                                                  "max_tokens": max_tokens})["choices"][0]["message"]
    assert answer.get("content"), f"no answer after the tool result: {answer}"
    return f"get_weather({arguments['city']}) -> {answer['content'].strip()[:40]!r}"
