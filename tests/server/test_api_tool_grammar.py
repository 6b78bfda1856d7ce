"""Forced tool calls end to end below HTTP, on the real SmolLM2 target with the shipped drafter:
the request is rendered (api/prompts.py chat_prompt), its tool-call grammar compiled in the
markup of the template's format (api/prompts.py grammar_for), decoded in every mode, and the text
parsed back into OpenAI tool calls (api/output.py). Both markups: SmolLM2's own template (no tool
support: the Hermes fallback) and a Qwen3.5-kind template (XML parameters,
tests/server/test_api_tool_render.py NATIVE). Constrained DDTree / DFlash output equals
constrained plain decoding token for token (fp32). Each markup decodes in one chain mode and one
tree mode, the two markups sharing the four modes out (DDTree budgets 1 / 16 / 64 and DFlash): the
decode loop treats every grammar alike, and every mode meets every grammar kind on the tiny
targets (tests/server/test_constrained_engine.py)."""

from __future__ import annotations

import copy
import json

import pytest

from ddtree_server.api.prompts import chat_prompt, grammar_for
from ddtree_server.api.schemas import ChatCompletionRequest
from ddtree_server.engine.engine import Engine
from tests.server.processor_cases import decode, first_diff
from tests.server.test_api_tool_render import NATIVE
from tests.server.drafter_fixtures import shipped_drafter

pytestmark = pytest.mark.slow

READ = {"type": "function", "function": {"name": "read_file", "description": "Read a text file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"},
                                     "follow": {"type": "boolean"}}, "required": ["path", "limit", "follow"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def engine(smollm2):
    drafter = shipped_drafter(smollm2)
    yield Engine(smollm2.model, smollm2.tokenizer, drafter, max_model_len=2048,
                 eos_token_ids=smollm2.eos_token_ids)
    smollm2.model.capture_layers = []


# max_tokens: the Hermes call ends by itself (48 tokens); SmolLM2 closes the qwen_xml call within
# 48 tokens and then only repeats `</tool_call>` up to the cap (12+ verify rounds in every mode)
@pytest.mark.parametrize("template, markup, max_tokens, modes", [
    (None, "hermes", 96, [("ddtree", 64), ("dflash", None)]), (NATIVE, "qwen_xml", 48, [("ddtree", 1), ("ddtree", 16)])])
def test_named_tool_call_parses_and_ddtree_equals_ar(engine, template, markup, max_tokens, modes):
    tokenizer = engine.tokenizer
    if template is not None:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = template
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Show me the first lines of notes.txt"}],
                                    tools=[WEATHER, READ], tool_choice={"type": "function",
                                                                        "function": {"name": "read_file"}})
    prompt = chat_prompt(tokenizer, request, {})
    assert prompt.markup == markup
    grammar = grammar_for(engine, request, prompt.markup)
    ref, _, _ = decode(engine, prompt.ids, mode="ar", max_tokens=max_tokens, grammar=grammar)
    text = engine.tokenizer.decode(ref, skip_special_tokens=True)
    assert len(ref) >= 40, text
    assert "<tool_call>" in text and ("<function=read_file>" in text) == (markup == "qwen_xml"), text
    prompt.parser.feed(text)
    prompt.parser.finish()
    message = prompt.parser.message()
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "read_file" and prompt.parser.finish_reason("stop") == "tool_calls"
    arguments = json.loads(call["function"]["arguments"])
    assert isinstance(arguments, dict), text
    if markup == "hermes":   # the JSON grammar fixes the arguments' schema
        assert set(arguments) == {"path", "limit", "follow"}, text
        assert isinstance(arguments["limit"], int) and isinstance(arguments["follow"], bool), arguments
    # qwen_xml: xgrammar's `qwen_3_5` structural tag fixes `<tool_call>\n<function=read_file>` but not
    # the parameters inside (SmolLM2 writes `<parameter=path>` without `</parameter>`); the parser
    # still returns the call, with the parameters it could read
    for mode, budget in modes:
        toks, _, stats = decode(engine, prompt.ids, mode=mode, budget=budget, max_tokens=max_tokens,
                                grammar=grammar)
        assert toks == ref, f"{mode}/{budget} diverged at {first_diff(toks, ref)}: {text!r}"
        assert stats.decode_rounds >= 12, (mode, budget, stats)
