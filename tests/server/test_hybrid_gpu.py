"""GPU exactness on a small random hybrid with CUDA graphs on (fp32): ar == dflash == ddtree, with
the fused GDN kernels on (the default on CUDA; ``DDTREE_KERNELS=0`` runs the torch path), and the
kernels against the torch path at the real Qwen3.6-27B GDN shape (fp32 and bf16).

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
from ddtree_server.kernels import runtime
from ddtree_server.models.hybrid import gdn_fast
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
    _assert_kernels_used({"commit", "chunk", "fold"} if method == "chunk" else {"commit"})


def _assert_kernels_used(kinds: set[str]):
    """The fused GDN kernels ran and passed their self-check (unless DDTREE_KERNELS=0)."""
    assert gdn_fast._failed == [], gdn_fast._failed
    if runtime.enabled("cuda"):
        assert kinds <= {k[0] for k in gdn_fast._checked}, gdn_fast._checked


def test_cuda_graphs_real_drafter_sliding_layers():
    from ddtree_server.models.drafter.model import DFlashDrafter
    from ddtree_server.models.drafter.config import DrafterConfig
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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gdn_kernels_equal_torch_path_at_27b_shape(dtype, tol):
    """One GDN mixer at the Qwen3.6-27B shape (16 key / 48 value heads of 128, conv 4): the fused
    path (pre, step / tree rule, gated norm) and the all-layer fold against the pure-torch path on
    a decode step and trees of 17, 33, 65 nodes and 65 nodes padded to 80 rows (relative L2)."""
    from ddtree_server.models.hybrid.config import HybridConfig
    from ddtree_server.models.hybrid.shapes import published

    if not runtime.enabled("cuda"):
        pytest.skip("DDTREE_KERNELS=0")
    errs = compare_fused(HybridConfig.from_any(published("qwen3.6-27b")[0]), dtype, "cuda")
    assert max(errs.values()) <= tol, errs
    assert gdn_fast._failed == []


def compare_fused(cfg, dtype, device, sizes=((1, 1), (17, 17), (33, 33), (65, 65), (80, 65))) -> dict:
    """Relative L2 errors of ``gdn_fast.fused`` / ``fold`` against ``GatedDeltaNet.mix`` / ``delta.fold``."""
    from types import SimpleNamespace

    from ddtree_server.kernels.gdn_state import fold_path
    from ddtree_server.models.hybrid import delta
    from ddtree_server.models.hybrid.cache import HybridCache
    from ddtree_server.models.hybrid.gdn import GatedDeltaNet
    from ddtree_server.models.hybrid.tree import tree_meta

    torch.manual_seed(0)
    with torch.device(device):
        mixer = GatedDeltaNet(cfg)
        cache = HybridCache(cfg, "chunk", 64, max(n for n, _ in sizes), dtype, torch.device(device))
    with torch.no_grad():
        mixer.A_log.uniform_(0.0, 2.7)
        mixer.dt_bias.normal_()
        mixer.norm.weight.normal_(1.0, 0.1)
        mixer.conv1d.weight.mul_(4.0)
        cache.state.normal_(0.0, 0.1)
        cache.conv[:, : cache.kernel - 1].normal_()
    mixer = mixer.to(dtype)
    li, errs = 1, {}

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()
    with torch.no_grad():
        for n, real in sizes:
            proj = mixer.in_proj(torch.randn(n, cfg.hidden_size, device=device, dtype=dtype))
            if n == 1:
                ctx = SimpleNamespace(meta=tree_meta(None, 1, cache.kernel, device), mode="commit")
                views = [cache.state[li], cache.conv[li, : cache.kernel - 1]]
            else:
                anc = torch.eye(n, dtype=torch.bool)
                anc[:real, :real] = gdn_fast.synthetic_tree(real)
                ctx = SimpleNamespace(meta=tree_meta(anc.to(device), n, cache.kernel, device), mode="chunk")
                views = [cache.kk[li, :n], cache.uu[li, :n], cache.GG[li, :n]]
            before = [t.clone() for t in views]
            want = mixer.mix(proj, cache, li, ctx)
            ref = [t.clone() for t in views]
            for t, b in zip(views, before):
                t.copy_(b)
            got = gdn_fast.fused(mixer, proj, cache, li, ctx)
            errs[f"out/{n}"] = rel(got, want)
            for j, (t, r) in enumerate(zip(views, ref)):
                errs[f"scratch{j}/{n}"] = rel(t, r)
        path = ctx.meta.anc[real - 1].nonzero()[:, 0]  # the last tree's deepest-numbered real node
        want = delta.fold(cache.state, cache.kk.index_select(1, path), cache.uu.index_select(1, path),
                          cache.GG.index_select(1, path))
        fold_path(cache.state, cache.kk, cache.uu, cache.GG, path)
        errs["fold"] = rel(cache.state, want)
    return errs


if __name__ == "__main__":  # without pytest: python tests/server/test_hybrid_gpu.py (from the repo root)
    for method in ("chunk", "node"):
        test_cuda_graphs_fp32_speculative_equals_ar(method)
    test_cuda_graphs_real_drafter_sliding_layers()
    test_graphed_logits_equal_eager()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        test_gdn_kernels_equal_torch_path_at_27b_shape(dtype, tol)
    print("hybrid GPU exactness: all equal")
