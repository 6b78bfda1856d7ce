"""The JSON-in-`<tool_call>` form (Hermes; Qwen2.5 and Qwen3 templates, and this server's fallback
prompt for templates without tool support):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse` reads the text between the tags of one call.
"""

from __future__ import annotations

import json
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse(block: str, functions: dict[str, Any]) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of one call, or None when `block` is not one JSON object
    with a non-empty string `name` and an object `arguments` (a JSON string encoding an object
    is accepted too; `parameters` is read as `arguments`; absent means `{}`). `functions` (the
    request's tools by name) is not needed by this format."""
    try:
        value = json.loads(block)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def render(name: str, arguments: dict[str, Any] | str) -> str:
    """One call in this form (history of the fallback prompt)."""
    return f"{OPEN}\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + f"\n{CLOSE}"
