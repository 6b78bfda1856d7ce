"""The batch engine's ddtree trees come from ONE device build per round (speculative/tree_gpu.py,
``draft_trees``): every request's tokens are still its own alone and plain decoding's (``ar``) at
temperature 0 in fp32 on the CPU, over many rounds, with tree budgets 1..64. Tiny random dense and
hybrid targets with a real DFlashDrafter (random weights), and the real SmolLM2 with its shipped
drafter."""

from __future__ import annotations

import pytest
import torch
from ddtree_server.engine.batch import trees as trees_module
from ddtree_server.engine.engine import Engine

from tests.server.batch_fixtures import MAX_LEN, check_alone_batched_ar, real_drafter
from tests.server.hybrid_fixtures import tiny_hybrid
from tests.server.tiny import EOS, ByteTokenizer, tiny_target
from tests.server.drafter_fixtures import shipped_drafter

BUDGETS = [1, 2, 3, 7, 16, 33, 64, None]


def _specs(max_tokens=30):
    prompts = ["the cat sat", "alpha beta", "1+2=", "on a mat zz", "gamma", "delta the", "a", "beta cat on"]
    out = [dict(rid=f"t{i}", prompt=list(p.encode()), mode="ddtree", budget=b,
                params=dict(max_tokens=max_tokens - i, ignore_eos=True, temperature=0.0), arrive=i % 3, cancel_after=None)
           for i, (p, b) in enumerate(zip(prompts, BUDGETS))]
    out += [dict(rid="d", prompt=list(b"sat on"), mode="dflash", budget=None,
                 params=dict(max_tokens=12, ignore_eos=True, temperature=0.0), arrive=0, cancel_after=None),
            dict(rid="p", prompt=list(b"zz"), mode="ar", budget=None,
                 params=dict(max_tokens=9, ignore_eos=True, temperature=0.0), arrive=1, cancel_after=None)]
    return out


@pytest.fixture
def builds(monkeypatch):
    """Every call of the batched tree builder (engine/batch/trees.py): its requests' caps."""
    calls = []

    def spy(logits, roots, caps):
        calls.append(list(caps))
        return wrapped(logits, roots, caps)

    wrapped = trees_module.draft_trees
    monkeypatch.setattr(trees_module, "draft_trees", spy)
    return calls


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_device_trees_equal_alone_and_ar(kind, builds):
    torch.set_num_threads(1)
    target = tiny_target() if kind == "dense" else tiny_hybrid("3gdn+attn", seed=21)
    engine = Engine(target, ByteTokenizer(), real_drafter(target), eos_token_ids=[EOS], max_model_len=MAX_LEN,
                    max_running=7, poison_freed_slots=True)
    ar = Engine(target, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=1)
    try:
        check_alone_batched_ar(engine, _specs(), ar)
    finally:
        target.capture_layers = []
    assert len(builds) > 10 and max(map(len, builds)) >= 5       # one build serves many requests
    assert max(max(c) for c in builds) == 64 and min(min(c) for c in builds) == 1


@pytest.mark.slow
def test_smollm2_shipped_drafter_device_trees_equal_alone_and_ar(smollm2, builds):

    model = smollm2.model
    drafter = shipped_drafter(smollm2)
    texts = ["def fib(n):", "The capital of France is", "1, 2, 3, 4,", "import numpy as np\n", "Once upon a time"]
    try:
        engine = Engine(model, smollm2.tokenizer, drafter, max_model_len=160, max_running=4,
                        eos_token_ids=smollm2.eos_token_ids)
        specs = [dict(rid=f"s{i}", prompt=engine.encode(t), mode="ddtree", budget=b,
                      params=dict(max_tokens=16, ignore_eos=True, temperature=0.0), arrive=0, cancel_after=None)
                 for i, (t, b) in enumerate(zip(texts, [1, 7, 24, 64, 64]))]
        ar = Engine(model, smollm2.tokenizer, max_model_len=160, max_running=1, eos_token_ids=smollm2.eos_token_ids)
        alone: dict = {}
        check_alone_batched_ar(engine, specs, ar, stats=alone)
        rounds = alone[specs[3]["rid"]].decode_rounds   # its run alone: ddtree, budget 64, 16 tokens
    finally:
        model.capture_layers = []
    assert len(builds) >= 3 and max(map(len, builds)) == 4
    assert rounds < 16 / 1.5    # the shipped drafter's trees are accepted
