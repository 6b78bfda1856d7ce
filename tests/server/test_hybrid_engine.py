"""The engine on a hybrid (Qwen3.5-style) target: dflash and ddtree give ar's tokens exactly.

Tiny random hybrid (fp32, CPU), byte tokenizer. The drafter is the TEST DOUBLE ``OracleDrafter``
(tests/server/tiny.py): it knows the target's greedy continuation and is wrong at every 4th
position (wrong top-1, right token at rank 2). Accepted paths are long, and DDTree often accepts
a node that is not its parent's first child (the recurrent / conv states of a sibling branch are
committed), which the test asserts. Also through the graphed wrapper's static path
(``GraphedHybrid(capture=False)``) and with the real ``DFlashDrafter`` (random weights).
"""

from __future__ import annotations

import pytest
import torch

from ddtree_server.engine import decode
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams
from ddtree_server.models.hybrid.graphs import GraphedHybrid
from tests.server.hybrid_fixtures import tiny_hybrid
from tests.server.tiny import EOS, VOCAB, ByteTokenizer, OracleDrafter

PROMPTS = [list(b"Hello there, general"), list(b"The quick brown fox"), list(b"1+1=2, 2+2="),
           list(b"Once upon a time")]
N_NEW, LAYERS, HIDDEN, BLOCK = 48, [0, 2, 3], 64, 16


@pytest.fixture(scope="module")
def hybrid():
    torch.set_num_threads(1)
    return tiny_hybrid("3gdn+attn", seed=21)


def _engine(target, drafter=None, **kw):
    return Engine(target, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=160, **kw)


def _run(engine, ids, mode=None, budget=None):
    toks, stats = [], None
    for ev in engine.generate(ids, SamplingParams(max_tokens=N_NEW, ignore_eos=True), mode=mode, tree_budget=budget):
        toks += ev.token_ids
        stats = ev.stats or stats
    return toks, stats


@pytest.fixture(scope="module")
def references(hybrid):
    ar = _engine(hybrid)
    return [(ids, _run(ar, ids)[0]) for ids in PROMPTS]


class Recorder:
    """Records each round's tree (via the ddtree builder) and accepted path (via cache.keep)."""

    def __init__(self, monkeypatch):
        self.trees, self.paths = [], []
        build = decode.ddtree_builder

        def record_build(*args):
            tree = build(*args)
            self.trees.append(tree)
            return tree
        monkeypatch.setattr(decode, "ddtree_builder", record_build)

    def wrap(self, engine):
        cache = engine.batch.runner.caches[0]   # one request at a time: always slot 0
        keep = cache.keep

        def record_keep(start, rows, rows_on_device=None):
            self.paths.append(list(rows))
            return keep(start, rows, rows_on_device)
        cache.keep = record_keep
        return engine

    def sibling_rounds(self) -> int:
        """Rounds whose accepted path goes through a node that is not its parent's first child."""
        count = 0
        for tree, path in zip(self.trees, self.paths):
            count += any(j != min(tree.children[tree.parents[j]].values()) for j in path[1:])
        return count


def _with_recorder(engine, rec):
    return rec.wrap(engine)


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("mode,budget", [("ddtree", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64), ("dflash", None)])
def test_speculative_equals_ar_on_hybrid(hybrid, references, monkeypatch, mode, budget, graphed):
    target = GraphedHybrid(hybrid, capture=False) if graphed else hybrid
    rec = Recorder(monkeypatch)
    taus, rounds = [], 0
    for ids, ref in references:
        drafter = OracleDrafter(len(ids), ref, vocab=VOCAB, hidden=HIDDEN, layer_ids=LAYERS, block_size=BLOCK)
        engine = _with_recorder(_engine(target, drafter), rec)
        toks, stats = _run(engine, ids, mode, budget)
        assert toks == ref, f"{mode}/{budget} diverged at {next(i for i, (a, b) in enumerate(zip(toks, ref)) if a != b)}"
        taus.append(stats.mean_acceptance_length)
        rounds += stats.decode_rounds
    tau = sum(taus) / len(taus)
    if mode == "ddtree" and budget >= 16:
        assert tau >= 3.0, taus
        assert len(rec.paths) == rounds == len(rec.trees)
        assert rec.sibling_rounds() >= rounds // 5, (rec.sibling_rounds(), rounds)
        assert max(len(p) for p in rec.paths) >= 6
    if mode == "dflash":
        assert 1.5 <= tau <= 4.0, taus  # the chain stops at every wrong top-1


def test_real_drafter_random_weights_equals_ar(hybrid, references):
    from ddtree_server.models.drafter.model import DFlashDrafter
    from ddtree_server.models.drafter.config import DrafterConfig

    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
           "dflash_config": {"mask_token_id": 257, "target_layer_ids": LAYERS}, "num_hidden_layers": 1,
           "hidden_size": HIDDEN, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 10000.0}
    torch.manual_seed(1)
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw), hybrid.embed_tokens, hybrid.lm_head).eval()
    for ids, ref in references[:2]:
        eng = _engine(hybrid, drafter)
        assert eng.default_mode == "ddtree"
        for mode, budget in (("dflash", None), ("ddtree", None), ("ddtree", 24)):
            assert _run(eng, ids, mode, budget)[0] == ref, (mode, budget)
