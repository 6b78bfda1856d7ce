"""End-to-end function calling: the official `openai` client against the real server (SmolLM2, CPU, fp32).

SmolLM2's chat template ignores `tools`, so the server writes its fallback prompt (Hermes-style
`<tool_call>` JSON, api/tools/render.py). The 135M model does not call tools from that prompt
alone, but it follows a conversation in which it called the tool twice before: that history
(sent as OpenAI `tool_calls` / `tool` messages) makes it call again, greedily, every time.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.server.serverproc import MODEL

pytest_plugins = ["tests.server.api_fixtures"]
pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call(i: int, city: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"}, call(1, "Paris"),
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "Weather in Rome?"}, call(2, "Rome"),
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"}, {"role": "assistant", "content": "Rain."},
    {"role": "user", "content": "Weather in Oslo?"},
]


def ask(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                          max_tokens=48, **kwargs)


def test_auto_tool_call_round_trip(api_client):
    first = ask(api_client, HISTORY)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [tool_call] = choice.message.tool_calls
    assert tool_call.type == "function" and tool_call.id.startswith("call_")
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Oslo"}
    # the call goes back with its result; the answer is text
    turn = choice.message.model_dump(exclude_none=True)
    result = {"role": "tool", "tool_call_id": tool_call.id, "content": "snow, -3 C"}
    second = ask(api_client, [*HISTORY, turn, result])
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    assert second.choices[0].message.content and "<tool" not in second.choices[0].message.content


READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["path"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("choice, name", [
    ("required", None), ({"type": "function", "function": {"name": "read_file"}}, "read_file")])
def test_forced_tool_choice_calls_a_tool_streamed_and_plain(api_client, choice, name):
    """A tool-call grammar (constrained decoding) makes even this model call; the streamed
    deltas add up to the plain answer; the call's result fed back gets a text answer."""
    # "required" with one call: with parallel calls allowed the answer may go on with more calls
    # (nothing else: constrained/compiler.calls_only) until the model ends it; SmolLM2 repeats its call
    kwargs = dict(tools=[WEATHER, READ], tool_choice=choice, **({"parallel_tool_calls": False} if name is None else {}))
    plain = api_client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=64, **kwargs)
    choice_ = plain.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.tool_calls
    for call in choice_.message.tool_calls:
        assert call.function.name in ("get_weather", "read_file") and (name is None or call.function.name == name)
        arguments = json.loads(call.function.arguments)
        assert isinstance(arguments, dict) and ("city" in arguments or "path" in arguments)
    streamed, finish, _ = reassemble(api_client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=64, stream=True, **kwargs))
    expected = choice_.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
    expected.setdefault("content", None)
    assert without_ids(streamed) == without_ids(expected) and finish == "tool_calls"
    turn = choice_.message.model_dump(exclude_none=True)
    results = [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in choice_.message.tool_calls]
    answer = api_client.chat.completions.create(model=MODEL, messages=[*ASK, turn, *results], tools=[WEATHER, READ],
                                                temperature=0, max_tokens=24)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_tool_choice_none_never_returns_tool_calls(api_client):
    response = ask(api_client, HISTORY, tool_choice="none")
    assert response.choices[0].finish_reason in ("stop", "length")
    assert not response.choices[0].message.tool_calls


def reassemble(stream) -> tuple[dict, str, list]:
    """The message a client builds from the chunks (OpenAI's joining rules), the finish reason
    and the tool-call deltas in order."""
    content, calls, finish, pieces = [], {}, None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        assert "<tool_call" not in (delta.content or "")
        content.append(delta.content or "")
        for part in delta.tool_calls or []:
            pieces.append(part)
            entry = calls.setdefault(part.index, {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            entry["id"] = part.id or entry["id"]
            entry["function"]["name"] += part.function.name or "" if part.function else ""
            entry["function"]["arguments"] += part.function.arguments or "" if part.function else ""
        finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish, pieces


def without_ids(message: dict) -> dict:
    for entry in message.get("tool_calls") or []:
        entry["id"] = "call"
    return message


def test_stream_reassembles_to_the_plain_response(api_client):
    plain = ask(api_client, HISTORY).choices[0]
    streamed, finish, pieces = reassemble(ask(api_client, HISTORY, stream=True))
    expected = plain.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
    expected.setdefault("content", None)
    assert without_ids(streamed) == without_ids(expected) and finish == plain.finish_reason == "tool_calls"
    # OpenAI's order: id, type and name with empty arguments first, then the arguments
    assert pieces[0].id and pieces[0].function.name == "get_weather" and pieces[0].function.arguments == ""
    assert all(p.id is None and p.function.name is None for p in pieces[1:])


def test_parallel_tool_calls_false_is_accepted(api_client):
    response = ask(api_client, HISTORY, parallel_tool_calls=False)
    assert len(response.choices[0].message.tool_calls or []) <= 1


def test_first_request_without_temperature_uses_the_model_defaults(api_client):
    """The embedded model's sampling defaults (temperature 0.2, top_p 0.9) answer sensibly."""
    response = api_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24, seed=1)
    assert "Paris" in response.choices[0].message.content


# ---- hostile input: a clear 4xx in bounded time ------------------------------------------------

def post(api_http, body: dict):
    start = time.monotonic()
    response = api_http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 8, **body})
    return response, time.monotonic() - start


def fn(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


def deep_schema(levels: int) -> dict:
    schema = node = {"type": "object"}
    for _ in range(levels):
        node["properties"] = {"x": {"type": "object"}}
        node = node["properties"]["x"]
    return schema


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param, words", [
    ({"messages": USER, "tools": [fn(f"f{i}") for i in range(1000)]}, "messages", "context window"),
    ({"messages": USER, "tools": [fn(f"f{i}") for i in range(1025)]}, "tools", "at most 1024"),
    ({"messages": USER, "tools": [fn("f"), fn("f")]}, "tools", "twice"),
    ({"messages": USER, "tools": [fn("deep", deep_schema(200))]}, "tools.0.function.parameters", "deeper"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "call_nothing", "content": "x"}], "tools": [fn("f")]},
     "messages.1.tool_call_id", "matches no tool call"),
    ({"messages": [*USER, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id", "needs the tool_call_id"),
    ({"messages": [*USER, call(1, "x" * 2_000_000)]}, "messages", "context window"),
    ({"messages": USER, "tools": [fn("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", None),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools.0.function.parameters", None),
    ({"messages": USER, "tools": [fn("f")], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
    ({"messages": USER, "tools": [fn("f", {"type": "object", "properties": {"x": {"type": "no-such-type"}}})],
      "tool_choice": "required"}, "tools[0].function.parameters", None),
])
def test_hostile_tool_requests_are_clear_400s(api_http, body, param, words):
    response, seconds = post(api_http, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if words:
        assert words in error["message"], error
    assert seconds < 30


def test_arguments_that_are_not_json_still_render(api_http):
    bad = call(1, "Paris")
    bad["tool_calls"][0]["function"]["arguments"] = "{not json"
    response, _ = post(api_http, {"messages": [*USER, bad, {"role": "tool", "tool_call_id": "call_1", "content": "ok"}],
                                  "tools": [WEATHER], "temperature": 0})
    assert response.status_code == 200, response.text
