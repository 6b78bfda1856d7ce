"""GPU exactness on a small random hybrid with CUDA graphs on (fp32): ar == dflash == ddtree.

Run by the lead on the H200 machine: ``pytest -m gpu -q tests/server/test_hybrid_gpu.py``
(skips without CUDA). Uses no transformers Qwen3.5 class (the GPU machine has transformers 5.17).
The drafters are the ``OracleDrafter`` TEST DOUBLE (long accepted paths, sibling commits) and the
real ``DFlashDrafter`` with a scaled-down z-lab Qwen3.6 config (sliding layers), both through the
engine exactly as served: GraphedHybrid and GraphedDrafter capture real CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams
from ddtree_server.models.hybrid.graphs import GraphedHybrid
from tests.server.hybrid_fixtures import VOCAB, tiny_hybrid_ours
from tests.server.tiny import EOS, ByteTokenizer, OracleDrafter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = [list(b"Hello there, general"), list(b"The quick brown fox"), list(b"1+1=2, 2+2=")]
N_NEW = 64


def _tokens(engine, ids, mode, budget=None):
    params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    return [t for ev in engine.generate(ids, params, mode=mode, tree_budget=budget) for t in ev.token_ids]


@pytest.mark.parametrize("method", ["chunk", "node"])
def test_cuda_graphs_fp32_speculative_equals_ar(method):
    model = tiny_hybrid_ours("qwen3.6x2", seed=61, method=method, device="cuda")
    ar = Engine(model, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=256)
    assert isinstance(ar.target, GraphedHybrid)
    for ids in PROMPTS:
        ref = _tokens(ar, ids, "ar")
        drafter = OracleDrafter(len(ids), ref, vocab=VOCAB, hidden=64, layer_ids=[1, 3, 6], block_size=16)
        engine = Engine(model, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=256)
        for mode, budget in (("dflash", None), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)):
            assert _tokens(engine, ids, mode, budget) == ref, (method, mode, budget)
        assert any(st.graph is not None for st in engine.target._static.values())


def test_cuda_graphs_real_drafter_sliding_layers():
    from ddtree_server.models.drafter import DFlashDrafter
    from ddtree_server.models.drafter_config import DrafterConfig
    from tests.server.drafter_fixtures import qwen36_drafter_config, randomize

    model = tiny_hybrid_ours("qwen3.6x2", seed=62, device="cuda")
    raw = qwen36_drafter_config()
    drafter = randomize(DFlashDrafter(DrafterConfig.from_dict(raw), model.embed_tokens, model.lm_head), seed=5, scale=0.1)
    drafter = drafter.to("cuda").eval()
    ar = Engine(model, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=256)
    engine = Engine(model, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=256)
    for ids in PROMPTS:
        ref = _tokens(ar, ids, "ar")
        for mode, budget in (("dflash", None), ("ddtree", 16), ("ddtree", 64)):
            assert _tokens(engine, ids, mode, budget) == ref, (mode, budget)
    assert engine.drafter.enabled  # the drafter's graphs passed their self-check


def test_graphed_logits_equal_eager():
    model = tiny_hybrid_ours("mixed6", seed=63, device="cuda")
    graphed = GraphedHybrid(model)
    ids = torch.randint(0, 256, (40,), device="cuda")
    with torch.no_grad():
        a, b = model.new_cache(128), graphed.new_cache(128)
        model.forward(a, ids[:30], torch.arange(30, device="cuda"))
        graphed.forward(b, ids[:30], torch.arange(30, device="cuda"))
        anc = torch.ones(10, 10, dtype=torch.bool, device="cuda").tril_()
        anc[5:, 1:5] = False  # rows 5.. hang off the root: a second branch
        pos = anc.sum(1) - 1 + 30
        want, _ = model.forward(a, ids[30:], pos, tree_mask=anc)
        got, _ = graphed.forward(b, ids[30:], pos, tree_mask=anc)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        a.keep(30, [0, 5, 6]), b.keep(30, [0, 5, 6])
        torch.testing.assert_close(a.state, b.state, rtol=1e-4, atol=1e-4)


if __name__ == "__main__":  # without pytest: python tests/server/test_hybrid_gpu.py (from the repo root)
    for method in ("chunk", "node"):
        test_cuda_graphs_fp32_speculative_equals_ar(method)
    test_cuda_graphs_real_drafter_sliding_layers()
    test_graphed_logits_equal_eager()
    print("hybrid GPU exactness: all equal")
