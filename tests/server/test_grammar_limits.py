"""Grammar compiler refusals: bounded time, a message naming the problem (byte tokenizer)."""

from __future__ import annotations

import time

import pytest

from ddtree_server.constrained.compiler import MAX_TOOLS, GrammarCompiler
from ddtree_server.constrained.limits import MAX_DEPTH, GrammarError, check_schema
from tests.server.tiny import EOS, VOCAB, ByteTokenizer

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}, "required": ["x"]}}}


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(ByteTokenizer(), VOCAB, [EOS])


def test_very_deep_schema_is_refused_without_recursion():
    schema: dict = {"type": "integer"}
    for _ in range(20000):
        schema = {"type": "array", "items": schema}
    t0 = time.monotonic()
    with pytest.raises(GrammarError, match=f"deeper than {MAX_DEPTH}"):
        check_schema(schema, "s")
    assert time.monotonic() - t0 < 2


def test_legitimately_recursive_schema_compiles(compiler):
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v"]}}, "$ref": "#/$defs/node"}
    assert compiler.json_schema(tree).kind == "json_schema"


def test_compile_time_limit(compiler):
    slow = GrammarCompiler(ByteTokenizer(), VOCAB, [EOS], timeout_s=0.001)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(400)}}
    with pytest.raises(GrammarError, match="took longer than"):
        slow.json_schema(schema)


@pytest.mark.parametrize("tools, choice, markup, needle", [
    ([], "required", "hermes", "requires tools"),
    ([TOOL] * (MAX_TOOLS + 1), "required", "hermes", f"at most {MAX_TOOLS}"),
    ([TOOL], {"type": "function", "function": {"name": "g"}}, "hermes", "not in tools"),
    ([TOOL], "auto", "hermes", "tool_choice must be"),
    ([TOOL], "required", "pythonic", "unknown tool-call markup"),
    ([{"type": "function", "function": {"name": ""}}], "required", "hermes", "non-empty string"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}], "required", "hermes",
     "not a valid JSON Schema"),
])
def test_tool_grammar_refusals(compiler, tools, choice, markup, needle):
    with pytest.raises(GrammarError, match=needle):
        compiler.tool_calls(tools, choice, markup=markup)


def test_response_format_kinds(compiler):
    assert compiler.response_format(None) is None and compiler.response_format({"type": "text"}) is None
    assert compiler.response_format({"type": "json_object"}).kind == "json_object"
    with pytest.raises(GrammarError) as err:
        compiler.response_format({"type": "regex"})
    assert err.value.param == "response_format.type"


HERMES = '<tool_call>\n{"name": "f", "arguments": {"x": 5}}\n</tool_call>'
QWEN_XML = "<tool_call>\n<function=f>\n<parameter=x>\n5\n</parameter>\n</function>\n</tool_call>"


def _accepts(grammar, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammar.compiled)
    return all(matcher.accept_token(b) for b in text.encode()) and matcher.accept_token(EOS)


@pytest.mark.parametrize("markup, text, reasoning", [
    ("hermes", HERMES, "disabled"), ("qwen_xml", QWEN_XML, "disabled"),
    ("qwen_xml", "let me think</think>\n\n" + QWEN_XML, "enabled")])
def test_tool_grammars_take_the_markup(compiler, markup, text, reasoning):
    named = {"type": "function", "function": {"name": "f"}}
    for choice in ("required", named):
        grammar = compiler.tool_calls([TOOL], choice, markup=markup, reasoning=reasoning)
        assert _accepts(grammar, text)
        assert reasoning == "enabled" or not _accepts(grammar, "Sure! " + text)   # no text before the call
        assert not _accepts(grammar, text.replace("5", '"five"'))          # arguments follow the schema
