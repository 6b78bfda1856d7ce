"""Request models of function calling (OpenAI's shapes): `tools`, `tool_choice`, an assistant
message's `tool_calls`.

Limits (a clear 400 instead of unbounded work): at most MAX_TOOLS functions with distinct names
matching OpenAI's `^[a-zA-Z0-9_-]{1,64}$`; a `parameters` schema nested at most MAX_SCHEMA_DEPTH
levels; `parameters` must be a JSON object (a JSON Schema of an object).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator

MAX_TOOLS = 1024           # functions per request
MAX_SCHEMA_DEPTH = 32      # nesting of objects/arrays inside one `parameters` schema
NAME_PATTERN = r"^[a-zA-Z0-9_.\-]{1,64}$"


def depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value (scalars 0), counting no further than `limit` + 1."""
    stack, deepest = [(value, 0)], 0
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            level += 1
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            stack.extend((child, level) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


class FunctionDef(BaseModel):
    """`tools[i].function`: name, description and the arguments' JSON Schema."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: StrictStr = Field(..., pattern=NAME_PATTERN)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the parameters schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
        return value


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: StrictStr


class NamedToolChoice(BaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: StrictStr
    arguments: StrictStr = Field(..., description="The arguments as a JSON string (OpenAI's encoding).")


class ToolCall(BaseModel):
    """One entry of an assistant message's `tool_calls` (conversation history)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


def check_tools(tools: list[Tool] | None) -> list[Tool] | None:
    """`tools` unchanged; ValueError for too many functions or a repeated name."""
    if not tools:
        return tools
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools per request (got {len(tools)})")
    seen: set[str] = set()
    for tool in tools:
        if tool.function.name in seen:
            raise ValueError(f"the function name {tool.function.name!r} appears twice")
        seen.add(tool.function.name)
    return tools
