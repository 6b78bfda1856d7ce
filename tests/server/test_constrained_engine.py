"""Constrained decoding, penalties and logprobs stay exact under speculation (tiny targets, fp32).

Tiny random Qwen3 (dense) and Qwen3.5 (hybrid) targets with the byte tokenizer. The drafter is the
TEST DOUBLE ``OracleDrafter`` (tests/server/tiny.py) fed with the processed ``ar`` output: it is
wrong at every 4th position, and its wrong token is often one the grammar refuses, so trees carry
refused branches and DDTree recovers through siblings; a real ``DFlashDrafter`` with random
weights proposes mostly refused tokens. Every case runs many rounds (>= 48 tokens).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from ddtree_server.engine.engine import Engine
from tests.server.hybrid_fixtures import tiny_hybrid
from tests.server.processor_cases import PENALTIES, SCHEMAS, SPEC_CASES, decode, first_diff
from tests.server.tiny import EOS, VOCAB, ByteTokenizer, OracleDrafter, tiny_target

LAYERS, HIDDEN = [0, 2, 3], 64
PROMPT = list(b"<user>Answer in JSON, please.\n<assistant>")
TEXT_PROMPT = list(b"The quick brown fox jumps over")


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def target(request):
    torch.set_num_threads(1)
    return tiny_target(seed=3) if request.param == "dense" else tiny_hybrid("3gdn+attn", seed=21)


def _engine(target, drafter=None):
    return Engine(target, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=400)


def _oracle(prompt, reference):
    return OracleDrafter(len(prompt), reference, vocab=VOCAB, hidden=HIDDEN, layer_ids=LAYERS)


@pytest.fixture(scope="module")
def grammars(target):
    compiler = _engine(target).grammars
    return {name: compiler.json_schema(schema) for name, schema in SCHEMAS.items()}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_speculative_equals_ar(target, grammars, name):
    ref, ref_lps, stats = decode(_engine(target), PROMPT, max_tokens=200, grammar=grammars[name], logprobs=2)
    assert stats.generated_tokens >= 48 and len(ref_lps) == len(ref)
    doc = json.loads(bytes(ref).decode("utf-8"))
    jsonschema.validate(doc, SCHEMAS[name])
    for mode, budget in SPEC_CASES:
        drafter = _oracle(PROMPT, ref)
        toks, lps, st = decode(_engine(target, drafter), PROMPT, mode=mode, budget=budget, max_tokens=200,
                               grammar=grammars[name], logprobs=2)
        assert toks == ref, f"{mode}/{budget} diverged at {first_diff(toks, ref)}"
        assert st.decode_rounds >= 4 and st.decode_rounds == drafter.calls
        assert max(abs(a.logprob - b.logprob) for a, b in zip(lps, ref_lps)) < 1e-4


def test_json_object_with_random_drafter(target):
    from ddtree_server.models.drafter.model import DFlashDrafter
    from ddtree_server.models.drafter.config import DrafterConfig

    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
           "dflash_config": {"mask_token_id": 257, "target_layer_ids": LAYERS}, "num_hidden_layers": 1,
           "hidden_size": HIDDEN, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 10000.0}
    torch.manual_seed(1)
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw), target.embed_tokens, target.lm_head).eval()
    grammar = _engine(target).grammars.json_object()
    ref, _, _ = decode(_engine(target), PROMPT, max_tokens=64, grammar=grammar)
    assert bytes(ref).startswith(b"{")
    eng = _engine(target, drafter)
    for mode, budget in (("dflash", None), ("ddtree", 24), ("ddtree", 64)):
        assert decode(eng, PROMPT, mode=mode, budget=budget, max_tokens=64, grammar=grammar)[0] == ref, (mode, budget)


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_penalties_speculative_equals_ar(target, name):
    params = PENALTIES[name]
    plain, _, _ = decode(_engine(target), TEXT_PROMPT, max_tokens=64, ignore_eos=True)
    ref, ref_lps, _ = decode(_engine(target), TEXT_PROMPT, max_tokens=64, ignore_eos=True, logprobs=3, **params)
    assert len(ref) == 64 and ref != plain   # the setting changes the output
    for mode, budget in SPEC_CASES:
        toks, lps, _ = decode(_engine(target, _oracle(TEXT_PROMPT, ref)), TEXT_PROMPT, mode=mode, budget=budget,
                              max_tokens=64, ignore_eos=True, logprobs=3, **params)
        assert toks == ref, f"{name} {mode}/{budget} diverged at {first_diff(toks, ref)}"
        assert [x.token_id for x in lps] == ref
        assert max(abs(a.logprob - b.logprob) for a, b in zip(lps, ref_lps)) < 1e-4


def test_logprobs_consistent_with_choice(target):
    toks, lps, _ = decode(_engine(target), TEXT_PROMPT, max_tokens=48, ignore_eos=True, logprobs=5,
                          frequency_penalty=0.5)
    assert len(lps) == len(toks) == 48
    for tok, lp in zip(toks, lps):
        values = [v for _, v in lp.top]
        assert len(lp.top) == 5 and values == sorted(values, reverse=True)
        assert lp.top[0][0] == tok and lp.top[0][1] == lp.logprob <= 0.0   # greedy: the top token
    # at T > 0 the sampled token's logprob is its entry among the alternatives when listed
    toks, lps, _ = decode(_engine(target), TEXT_PROMPT, max_tokens=48, ignore_eos=True, logprobs=20,
                          temperature=1.0, seed=7)
    for tok, lp in zip(toks, lps):
        listed = dict(lp.top)
        assert tok not in listed or listed[tok] == lp.logprob
        assert lp.logprob <= lp.top[0][1]
