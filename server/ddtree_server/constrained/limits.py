"""Bounds and checks on a JSON schema before it is compiled into a grammar (pure, no xgrammar).

Grammar compilation cost grows with the schema: measured with xgrammar on the SmolLM2 tokenizer
(docs/constrained.md, "Limits"), 2,000 optional properties in one object take 14 s, 400 nested
objects 6 s, and schemas that repeat a subschema grow exponentially in their JSON size. So a schema
is refused (GrammarError, HTTP 400) before compiling when its compact JSON is over MAX_SCHEMA_BYTES,
it nests deeper than MAX_DEPTH containers, or one object lists more than MAX_PROPERTIES properties;
what passes compiles in well under a second, and the compile itself runs under a time limit
(constrained/compiler.py). A schema that is not a valid JSON Schema (Draft 2020-12 meta-schema,
checked with the `jsonschema` package) is refused with the validator's message and path.
"""

from __future__ import annotations

import json
from typing import Any

MAX_SCHEMA_BYTES = 32 * 1024   # compact JSON of one schema (all tool schemas together for tools)
MAX_DEPTH = 48                 # nested JSON objects/arrays inside the schema document
MAX_PROPERTIES = 512           # properties of one object schema


class GrammarError(ValueError):
    """A response format / tool grammar the server refuses (HTTP 400); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _depth_and_width(doc: Any) -> tuple[int, tuple[str, int] | None]:
    """Deepest container nesting of ``doc`` and the first object whose ``properties`` holds more
    than MAX_PROPERTIES entries (its JSON-pointer-like path and size). Iterative: no recursion."""
    deepest, wide = 0, None
    stack: list[tuple[Any, int, str]] = [(doc, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            props = node.get("properties")
            if wide is None and isinstance(props, dict) and len(props) > MAX_PROPERTIES:
                wide = (path or "/", len(props))
            if depth <= MAX_DEPTH:
                stack.extend((v, depth + 1, f"{path}/{k}") for k, v in node.items())
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                stack.extend((v, depth + 1, f"{path}/{i}") for i, v in enumerate(node))
    return deepest, wide


def check_schema(schema: Any, param: str) -> str:
    """The compact JSON text of ``schema`` after every check; raises GrammarError naming the problem.

    Checks, cheapest first: a JSON object; nesting depth <= MAX_DEPTH; size <= MAX_SCHEMA_BYTES;
    no object with more than MAX_PROPERTIES properties; valid under the JSON Schema meta-schema.
    """
    if not isinstance(schema, dict):
        raise GrammarError(f"{param} must be a JSON object (a JSON Schema), got {type(schema).__name__}", param)
    depth, wide = _depth_and_width(schema)
    if depth > MAX_DEPTH:
        raise GrammarError(f"{param} nests deeper than {MAX_DEPTH} levels; this server does not compile "
                           "such schemas", param)
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"{param} is not valid JSON: {exc}", param) from None
    size = len(text.encode("utf-8"))
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"{param} is {size} bytes of JSON; the limit is {MAX_SCHEMA_BYTES} bytes", param)
    if wide is not None:
        raise GrammarError(f"{param}: the object at {wide[0]} has {wide[1]} properties; the limit is "
                           f"{MAX_PROPERTIES}", param)
    from jsonschema import exceptions, validators

    cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise GrammarError(f"{param} is not a valid JSON Schema: {exc.message} (at {where})", param) from None
    except RecursionError:
        raise GrammarError(f"{param} nests too deeply to be checked", param) from None
    return text
