"""The prompt side of function calling: the request's `tools` and tool history as chat-template input.

* a template that reads `tools` (Qwen2.5/3/3.5/3.6, ...) gets them as `tools=[...]` (OpenAI's
  `{"type": "function", "function": {...}}` objects), assistant `tool_calls` with `arguments`
  decoded to an object (what these templates iterate over; a string that is not a JSON object
  stays a string) and `tool` messages with their `tool_call_id` and the called function's `name`;
* a template that ignores `tools` (SmolLM2's) gets the FALLBACK prompt: a system message listing
  the functions as JSON and asking for Hermes-style `<tool_call>` JSON (merged into the request's
  own first system message, else prepended), assistant calls written out in that form and tool
  results wrapped in `<tool_response>` tags.

`tool_choice: "none"` leaves the tools out of the prompt (history is still rendered). Every tool
message must answer a call of an earlier assistant message (`tool_call_id`), else a 400.
"""

from __future__ import annotations

import json
from typing import Any

from ddtree_server.api.responses import ApiError
from ddtree_server.api.tools import ToolFormat, hermes

FALLBACK = (
    "You can call functions. The functions are listed as JSON inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, exactly like this:\n<tool_call>\n"
    '{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n</tool_call>\n'
    "{how_many} The results come back inside <tool_response></tool_response> tags. "
    "Answer normally when no function is needed."
)
ONE_CALL = "Call at most one function per answer."
MANY_CALLS = "You may call several functions, one <tool_call> block each."


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def fallback_system(tools: list[dict[str, Any]], parallel: bool) -> str:
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return FALLBACK.format(tools=listing, how_many=MANY_CALLS if parallel else ONE_CALL)


def template_input(request: Any, fmt: ToolFormat) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template kwargs) for `request` (a ChatCompletionRequest). Raises
    ApiError(400) for a tool message that answers no earlier call."""
    offer = bool(request.tools) and request.tool_choice != "none"
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []] if offer else []
    parallel = request.parallel_tool_calls is not False
    called: dict[str, str] = {}    # tool_call_id -> function name
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        item = message.model_dump(exclude_none=True)
        item["role"] = "system" if message.role == "developer" else message.role
        item["content"] = message.text()
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                called[call.id] = call.function.name
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name,
                                           "arguments": _arguments(call.function.arguments)}})
            if fmt.native:
                item["tool_calls"] = calls
            else:
                del item["tool_calls"]
                text = [item["content"]] if item["content"] else []
                item["content"] = "\n".join(text + [hermes.render(c["function"]["name"], c["function"]["arguments"])
                                                    for c in calls])
        if message.role == "tool":
            if message.tool_call_id is None:
                raise ApiError(400, f"messages[{i}]: a tool message needs the tool_call_id of the call it answers",
                               param=f"messages.{i}.tool_call_id")
            if message.tool_call_id not in called:
                raise ApiError(400, f"messages[{i}].tool_call_id {message.tool_call_id!r} matches no tool call "
                                    "of an earlier assistant message", param=f"messages.{i}.tool_call_id")
            item.setdefault("name", called[message.tool_call_id])
            if not fmt.native:
                item["content"] = f"<tool_response>\n{item['content']}\n</tool_response>"
        messages.append(item)
    if not tools:
        return messages, {}
    if fmt.native:
        return messages, {"tools": tools}
    block = fallback_system(tools, parallel)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{block}".lstrip()}
    else:
        messages.insert(0, {"role": "system", "content": block})
    return messages, {}
