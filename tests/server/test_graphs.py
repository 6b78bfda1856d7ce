"""GraphedTarget: the padded static path (CUDA graphs) equals the eager TargetModel forward."""

from __future__ import annotations

import pytest
import torch

from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams
from ddtree_server.models.dense.graphs import GraphedTarget
from tests.server.tiny import EOS, VOCAB, ByteTokenizer, OracleDrafter, tiny_target


def _tree_mask(n, seed):
    """A random ancestor-or-self matrix of a tree of n nodes (node 0 = root)."""
    g = torch.Generator().manual_seed(seed)
    anc = torch.zeros(n, n, dtype=torch.bool)
    anc[0, 0] = True
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=g))
        anc[i] = anc[p]
        anc[i, i] = True
    return anc


def _check_equal(model, graphed, device):
    model.capture_layers = [0, 2]
    eager_cache, static_cache = model.new_cache(300), graphed.new_cache(300)
    prompt = torch.arange(40, device=device) % VOCAB
    a, fa = model.forward(eager_cache, prompt, torch.arange(40, device=device), last_only=True)
    b, fb = graphed.forward(static_cache, prompt, torch.arange(40, device=device), last_only=True)
    assert torch.allclose(a, b, atol=1e-4) and torch.allclose(fa, fb, atol=1e-4)
    s = 40
    for step, n in enumerate([1, 3, 16, 17, 1, 40]):
        ids = (torch.arange(n, device=device) * 7 + step) % VOCAB
        mask = _tree_mask(n, step).to(device) if step % 2 else None
        depth = mask.sum(-1) - 1 if mask is not None else torch.arange(n, device=device)
        pos = depth + s
        a, fa = model.forward(eager_cache, ids, pos, mask)
        b, fb = graphed.forward(static_cache, ids, pos, mask)
        assert torch.allclose(a, b, atol=1e-4), (step, n)
        assert torch.allclose(fa, fb, atol=1e-4)
        keep = [0] + [i for i in range(1, n) if i % 3 == 0]
        eager_cache.keep(s, keep)
        static_cache.keep(s, keep)
        s += len(keep)
        assert eager_cache.length == static_cache.length == s
        assert torch.allclose(eager_cache.k[:, :, :s], static_cache.k[:, :, :s], atol=1e-5)
    model.capture_layers = []


def test_static_path_equals_eager_cpu():
    torch.set_num_threads(1)
    model = tiny_target()
    _check_equal(model, GraphedTarget(model, capture=False), torch.device("cpu"))


def test_engine_over_static_path_equals_ar():
    model = tiny_target()
    graphed = GraphedTarget(model, capture=False, buckets=(1, 4, 16, 64))
    tok = ByteTokenizer()
    prompt = list(b"static shapes")
    ar = Engine(model, tok, max_model_len=150, eos_token_ids=[EOS])
    ref = [t for ev in ar.generate(prompt, SamplingParams(max_tokens=50, ignore_eos=True)) for t in ev.token_ids]
    for mode, budget in (("ar", None), ("dflash", None), ("ddtree", 3), ("ddtree", 40), ("ddtree", 100)):
        drafter = OracleDrafter(len(prompt), ref, vocab=VOCAB, hidden=64, layer_ids=[1, 2], block_size=8)
        eng = Engine(graphed, tok, drafter, max_model_len=150, eos_token_ids=[EOS])
        toks = [t for ev in eng.generate(prompt, SamplingParams(max_tokens=50, ignore_eos=True), mode=mode,
                                         tree_budget=budget) for t in ev.token_ids]
        assert toks == ref, (mode, budget)
    model.capture_layers = []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager():
    model = tiny_target()
    model = model.to("cuda")
    model._inv_freq.pop(torch.device("cuda"), None)
    _check_equal(model, GraphedTarget(model, capture=True), torch.device("cuda"))
