"""The XML form of Qwen3.5 / Qwen3.6 (and Qwen3-Coder) chat templates:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are plain text; `parse` converts each by the type its function's JSON Schema
declares (string kept as is; integer / number / boolean / null parsed; object / array and
untyped values read as JSON when they are JSON, else kept as text). One function per block.
"""

from __future__ import annotations

import json
import re
from typing import Any

FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _strip_newline(text: str) -> str:
    """The value between the tags without the one newline each tag adds."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    return text


def _types(schema: Any) -> list[str]:
    """JSON Schema types a property allows (`type` as string or list, or inside anyOf/oneOf)."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    found = [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)] if isinstance(kind, list) else []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            found += _types(option)
    if not found and "enum" in schema:
        found = ["enum"]
    return found


def convert(text: str, schema: Any) -> Any:
    """`text` as the JSON value its property schema asks for (the text itself when it does not fit)."""
    types = _types(schema)
    if "string" in types and not (len(types) > 1 and text.strip() == "null"):
        return text
    value = text.strip()
    if "null" in types and value.lower() in ("null", "none"):
        return None
    if "boolean" in types and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if "integer" in types or "number" in types:
        try:
            return int(value)
        except ValueError:
            pass
        try:
            number = float(value)
            if number == number and abs(number) != float("inf"):
                return int(number) if "number" not in types and number.is_integer() else number
        except ValueError:
            pass
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return text


def parse(block: str, functions: dict[str, Any]) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of one call, or None when `block` holds no complete
    `<function=NAME>...</function>` (or text other than whitespace around it)."""
    match = FUNCTION.search(block)
    if match is None or block[:match.start()].strip() or block[match.end():].strip():
        return None
    name = match.group(1).strip()
    schema = getattr(functions.get(name), "parameters", None) or {}
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    arguments = {}
    for param in PARAMETER.finditer(match.group(2)):
        key = param.group(1).strip()
        arguments[key] = convert(_strip_newline(param.group(2)), properties.get(key))
    if not name:
        return None
    return name, json.dumps(arguments, ensure_ascii=False)
