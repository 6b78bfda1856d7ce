"""Constrained decoding, penalties and logprobs on the real SmolLM2 target with the shipped drafter.

fp32, CPU. The shipped default drafter (assets/drafter) is a trained drafter: it proposes what the
model would write, and the grammar refuses some of it. Output must validate against the schema
(``jsonschema``) and equal constrained ``ar`` token for token under speculation; penalised output
likewise; logprobs agree across modes to fp32 rounding.

The tiny targets (tests/server/test_constrained_engine.py) run every schema, penalty and mode; here
each speculative path (a chain: DDTree budget 1 and DFlash; a tree: budgets 16 and 64) meets real
proposals once: the two schemas share the four modes out between them; the penalties run the tree that
accepts drafted tokens under them.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from ddtree_server.engine.engine import Engine
from tests.server.processor_cases import PENALTIES, SCHEMAS, SPEC_CASES, decode, first_diff
from tests.server.drafter_fixtures import shipped_drafter

pytestmark = pytest.mark.slow

ASK = ("Describe a fictional person as JSON with the fields of this schema, values invented and "
       "realistic: {schema}")


@pytest.fixture(scope="module")
def engine(smollm2):
    drafter = shipped_drafter(smollm2)
    yield Engine(smollm2.model, smollm2.tokenizer, drafter, max_model_len=1024,
                 eos_token_ids=smollm2.eos_token_ids)
    smollm2.model.capture_layers = []


# all four schemas run in every mode on the tiny targets; here each mode once, on one of two schemas
JSON_CASES = {"nested": [("ddtree", 64), ("dflash", None)], "strict": [("ddtree", 1), ("ddtree", 16)]}
assert sorted(sum(JSON_CASES.values(), []), key=str) == sorted(SPEC_CASES, key=str)


@pytest.mark.parametrize("name", sorted(JSON_CASES))
def test_json_schema_ddtree_equals_ar(engine, name):
    schema = SCHEMAS[name]
    grammar = engine.grammars.json_schema(schema)
    ids = engine.encode(ASK.format(schema=json.dumps(schema)))
    ref, ref_lps, stats = decode(engine, ids, mode="ar", max_tokens=160, grammar=grammar, logprobs=3)
    text = engine.tokenizer.decode(ref, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)
    assert len(ref) >= 20, text
    taus = {}
    for mode, budget in JSON_CASES[name]:
        toks, lps, st = decode(engine, ids, mode=mode, budget=budget, max_tokens=160, grammar=grammar, logprobs=3)
        assert toks == ref, f"{mode}/{budget} diverged at {first_diff(toks, ref)}: {text!r}"
        assert len(lps) == len(ref) and max(abs(a.logprob - b.logprob) for a, b in zip(lps, ref_lps)) < 1e-4
        assert st.decode_rounds >= 8, (mode, budget, st)   # the grammar state crosses many rounds
        taus[f"{mode}/{budget}"] = st.mean_acceptance_length
    tree = f"ddtree/{max(b for m, b in JSON_CASES[name] if m == 'ddtree')}"   # the largest tree of the case
    assert taus[tree] > 1.5, taus   # the trained drafter still gets tokens accepted in a tree


@pytest.mark.parametrize("name", ["all"])
def test_penalties_ddtree_equals_ar(engine, name):
    ids = engine.encode("Write a short poem about the sea and its waves.")
    n = 24   # 15+ decode rounds (asserted): the counts carry over many rounds
    plain, _, _ = decode(engine, ids, mode="ar", max_tokens=n, ignore_eos=True)
    ref, ref_lps, _ = decode(engine, ids, mode="ar", max_tokens=n, ignore_eos=True, logprobs=5, **PENALTIES[name])
    assert ref != plain
    # Under these penalties the chains (DDTree budget 1, DFlash) accept no drafted token here (one token
    # a round: nothing beyond ar; they run every penalty on the tiny targets); budget 64 accepts paths
    # (asserted), whose rows need the counts of the rounds before (an output miscounted when committed
    # diverges) and of their own path (a node given the root's counts moves a logprob by 3e-4).
    toks, lps, stats = decode(engine, ids, mode="ddtree", budget=64, max_tokens=n, ignore_eos=True, logprobs=5,
                              **PENALTIES[name])
    assert toks == ref, f"diverged at {first_diff(toks, ref)}"
    assert stats.decode_rounds >= 15 and stats.mean_acceptance_length > 1.3, stats
    assert max(abs(a.logprob - b.logprob) for a, b in zip(lps, ref_lps)) < 1e-4
    for a, b in zip(lps, ref_lps):
        assert a.top[0][0] == b.top[0][0] == a.token_id


def test_tool_call_grammars(engine):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}}}]
    ids = engine.encode("What is the weather in Paris right now?")
    named = {"type": "function", "function": {"name": "get_weather"}}
    for markup, choice in (("hermes", "required"), ("qwen_xml", named)):
        grammar = engine.grammars.tool_calls(tools, choice, markup=markup, parallel=False)
        ref, _, _ = decode(engine, ids, mode="ar", max_tokens=120, grammar=grammar)
        text = engine.tokenizer.decode(ref, skip_special_tokens=True)
        assert text.startswith("<tool_call>\n") and text.endswith(("</tool_call>", "</tool_call>\n")), text
        text = text.removesuffix("\n")   # the calls, a newline at most, then the end (compiler.calls_only)
        if markup == "hermes":
            call = json.loads(text[len("<tool_call>\n"):-len("</tool_call>")])
            assert call["name"] in ("get_weather", "get_time") and isinstance(call["arguments"], dict)
        else:
            assert "<function=get_" in text and "</function>" in text
        if isinstance(choice, dict):
            assert "get_weather" in text
        else:   # named calls, both markups: decoded speculatively in tests/server/test_api_tool_grammar.py
            toks, _, _ = decode(engine, ids, mode="ddtree", budget=16, max_tokens=120, grammar=grammar)
            assert toks == ref, (markup, choice)
