"""Tool-call and reasoning parsing of chat completions (api/tools/, api/output.py), as units.

Every case is fed to the parser whole and split at every character (and into random pieces):
the assembled message must be the same, so a stream and a plain response cannot differ.
"""

from __future__ import annotations

import json
import random

import pytest

from ddtree_server.api.output import OutputParser, assemble
from ddtree_server.api.tools import choose_format, hermes, qwen_xml
from ddtree_server.api.tools.schemas import FunctionDef

WEATHER = FunctionDef(name="get_weather", parameters={
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "celsius": {"type": "boolean"},
        "ratio": {"type": "number"}, "tags": {"type": "array"}, "filter": {"type": "object"},
        "note": {"type": ["string", "null"]}, "code": {"type": "string"}}})
FUNCTIONS = {"get_weather": WEATHER}


def run(text: str, pieces: list[str] | None = None, **kwargs) -> tuple[dict, list[dict]]:
    parser = OutputParser(functions=FUNCTIONS, **kwargs)
    deltas = []
    for piece in pieces if pieces is not None else [text]:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    return parser.message(), deltas


def without_ids(message: dict) -> dict:
    message = json.loads(json.dumps(message))
    for call in message.get("tool_calls") or []:
        assert call.pop("id").startswith("call_")
    return message


def same_when_split(text: str, **kwargs) -> dict:
    """The message of `text`, checked equal for every 2-way split and random many-way splits."""
    whole = without_ids(run(text, **kwargs)[0])
    for cut in range(len(text) + 1):
        assert without_ids(run(text, [text[:cut], text[cut:]], **kwargs)[0]) == whole, cut
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert without_ids(run(text, pieces, **kwargs)[0]) == whole
    return whole


HERMES = dict(parse=hermes.parse)
XML = dict(parse=qwen_xml.parse)


def test_hermes_call_with_text_before_and_nested_unicode_arguments():
    args = {"city": "Zürich 東京 🌧", "filter": {"a": [1, {"b": None}], "q": "say \"hi\" </tool_call"}}
    text = 'Let me check.\n<tool_call>\n' + json.dumps({"name": "get_weather", "arguments": args}) + "\n</tool_call>"
    message = same_when_split(text, **HERMES)
    assert message["content"] == "Let me check."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == args


def test_hermes_parallel_calls_and_parallel_false_keeps_the_first():
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    two = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    message = same_when_split(f"{one}\n{two}\n", **HERMES)
    assert message["content"] is None
    assert [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]] == ["Paris", "Rome"]
    message = same_when_split(f"{one}\n{two}", parallel=False, **HERMES)
    assert [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]] == ["Paris"]


def test_stray_closing_tags_after_a_call_are_dropped():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    message = same_when_split(call + "\n</tool_call>\n</tool_call>\nDone </tool_call>", **HERMES)
    assert message["content"] == "Done" and len(message["tool_calls"]) == 1
    # before any call a closing tag is just text
    assert same_when_split("a </tool_call> b", **HERMES)["content"] == "a </tool_call> b"


def test_stream_deltas_name_first_then_arguments():
    _, deltas = run('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', **HERMES)
    first, second = deltas
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first["tool_calls"][0]["id"].startswith("call_") and first["tool_calls"][0]["index"] == 0
    assert second["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',   # invalid JSON
    '<tool_call>\n["get_weather"]\n</tool_call>',                                    # not an object
    '<tool_call>\n{"arguments": {}}\n</tool_call>',                                  # no name
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',                    # arguments not an object
    '<tool_call>\n{"name": "get_weather", "arguments": {"ci',                        # cut off
    "I <tool_ca",                                                                     # partial tag at the end
    "a < b and <tool> <think> </tool_call>",                                          # look-alikes
])
def test_malformed_or_partial_markup_is_plain_content(text):
    message = same_when_split(text, **HERMES)
    assert "tool_calls" not in message and message["content"] == text


def test_unclosed_call_that_parses_is_a_call():
    message = same_when_split('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n', **HERMES)
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Lima"}


@pytest.mark.parametrize("tail", ["<", "</", "</tool", "</tool_call"])
def test_a_call_cut_inside_its_closing_tag_is_a_call(tail):
    """max_tokens may end the answer inside ``</tool_call>``: the JSON is whole, the call counts."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n' + tail
    message = same_when_split(text, **HERMES)
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Lima"}
    assert message.get("content") is None


def test_forced_tool_grammars_allow_calls_only():
    """A forced tool choice's grammar has no free text around the calls (compiler.calls_only), in
    every markup and reasoning mode, with and without parallel calls."""
    from xgrammar import builtin_structural_tag as tags

    from ddtree_server.constrained.compiler import MARKUPS, calls_only

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}]
    for model in MARKUPS.values():
        for reasoning in ("disabled", "enabled", "auto"):
            for parallel in (True, False):
                tag = tags.get_model_structural_tag(model, tools=tools, tool_choice="required",
                                                    reasoning=reasoning, parallel_tool_calls=parallel)
                before = tag.model_dump_json()
                tag.format = calls_only(tag.format)
                after = tag.model_dump_json()
                assert '"triggered_tags"' in before and '"triggered_tags"' not in after
                assert '"tags_with_separator"' in after


def test_arguments_given_as_a_json_string_and_parameters_key():
    assert hermes.parse('{"name": "f", "arguments": "{\\"x\\": 1}"}', {}) == ("f", '{"x": 1}')
    assert hermes.parse('{"name": "f", "parameters": {"x": 1}}', {}) == ("f", '{"x": 1}')
    assert hermes.parse('{"name": "f"}', {}) == ("f", "{}")
    assert hermes.parse('{"name": "f", "arguments": "not json"}', {}) is None
    assert hermes.parse("[" * 100000, {}) is None


XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=celsius>\nTrue\n</parameter>\n"
            "<parameter=ratio>\n0.5\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
            "<parameter=filter>\n{\"deep\": {\"x\": [1, 2]}}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
            "<parameter=code>\ndef f():\n    return 1 < 2\n\n</parameter>\n<parameter=extra>\n7\n</parameter>\n"
            "</function>\n</tool_call>")


def test_qwen_xml_values_converted_by_schema_types():
    message = same_when_split("Sure.\n\n" + XML_CALL, **XML)
    assert message["content"] == "Sure."
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {
        "city": "São Paulo", "days": 3, "celsius": True, "ratio": 0.5, "tags": ["a", "b"],
        "filter": {"deep": {"x": [1, 2]}}, "note": None, "code": "def f():\n    return 1 < 2\n", "extra": 7}


def test_qwen_xml_conversion_edges():
    assert qwen_xml.convert("42", {"type": "string"}) == "42"
    assert qwen_xml.convert("4.0", {"type": "integer"}) == 4
    assert qwen_xml.convert("many", {"type": "integer"}) == "many"
    assert qwen_xml.convert("1e3", {"type": "number"}) == 1000.0
    assert qwen_xml.convert("nan", {"type": "number"}) == "nan"
    assert qwen_xml.convert("x", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == "x"
    assert qwen_xml.convert("null", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) is None
    assert qwen_xml.convert("{bad", {"type": "object"}) == "{bad"


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # no </function>
    "<tool_call>\nhello <function=get_weather>\n</function>\n</tool_call>",                     # text around it
    "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>",                                    # Hermes JSON
])
def test_qwen_xml_malformed_is_content(text):
    message = same_when_split(text, **XML)
    assert "tool_calls" not in message and message["content"] == text


def test_reasoning_opened_by_the_prompt_then_a_call():
    text = "The user wants weather.\nI will call it.</think>\n\n" + XML_CALL
    message = same_when_split(text, reasoning=True, in_reasoning=True, **XML)
    assert message["reasoning_content"] == "The user wants weather.\nI will call it."
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_reasoning_opened_by_the_model_and_plain_answer():
    message = same_when_split("<think>\n2+2 is 4, ok\n</think>\n\nThe answer is 4.", reasoning=True)
    assert message == {"role": "assistant", "reasoning_content": "\n2+2 is 4, ok\n", "content": "The answer is 4."}
    # a <think> later in the answer is text; no template reasoning: untouched
    assert same_when_split("Use <think> tags.", reasoning=True)["content"] == "Use <think> tags."
    assert same_when_split("<think>x</think>y") == {"role": "assistant", "content": "<think>x</think>y"}


def test_unfinished_reasoning_stays_reasoning():
    message = same_when_split("still thinking </thi", reasoning=True, in_reasoning=True)
    assert message == {"role": "assistant", "reasoning_content": "still thinking </thi", "content": ""}


def test_tool_markup_inside_reasoning_is_not_a_call():
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call></think>done'
    message = same_when_split(text, reasoning=True, in_reasoning=True, **HERMES)
    assert "tool_calls" not in message and message["content"] == "done"


def test_plain_text_without_tools_is_untouched():
    text = "  Paris.\n\n"
    assert same_when_split(text) == {"role": "assistant", "content": text}
    assert same_when_split(text, **HERMES) == {"role": "assistant", "content": text}


def test_finish_reason():
    parser = OutputParser(parse=hermes.parse)
    parser.feed('<tool_call>{"name": "f"}</tool_call>')
    parser.finish()
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"
    assert OutputParser(parse=hermes.parse).finish_reason("stop") == "stop"


def test_assemble_joins_like_a_client():
    deltas = [{"content": "a"}, {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                 "function": {"name": "f", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"x"'}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]
    assert assemble(deltas)["tool_calls"] == [{"id": "call_1", "type": "function",
                                               "function": {"name": "f", "arguments": '{"x": 1}'}}]


def test_format_follows_the_family():
    assert choose_format("{% for tool in tools %}<tool_call>{% endfor %}").name == "hermes"
    assert choose_format("{% if tools %}<function=example_function_name>{% endif %}").name == "qwen_xml"
    assert choose_format("{% if tools %}{{ tools }}{% endif %}", "qwen3_5").name == "qwen_xml"
    fallback = choose_format("{{ messages }}", "llama")
    assert fallback.name == "hermes" and not fallback.native

