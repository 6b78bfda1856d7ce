"""kernels/gdn_*.py: the fused Gated DeltaNet kernels against their pure-torch references, under
TRITON_INTERPRET=1 on CPU (fp32 and fp16; the interpreter mishandles bf16), plus the wiring in
models/hybrid/gdn_fast.py (kernels on == kernels off through a whole HybridTarget; a broken kernel
is caught by the self-check and the torch result is kept) and a compile of every launch for
sm_90 (Hopper) with Triton's bundled ptxas, which catches what the interpreter does not type-check.

The interpreter must be chosen before triton is first imported, so the interpreted parts run in
one child process for the module (interp_child.py)."""

from __future__ import annotations

import pytest

from tests.server.interp_child import module_child

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

_CHILD = r"""
import logging, os, random, torch
from tests.server.interp_fast import install
install()
from ddtree_server.kernels import gdn_tree
from ddtree_server.kernels.gdn_pre import gdn_pre
from ddtree_server.kernels.gdn_tree import tree_rule
from ddtree_server.kernels.gdn_state import step_rule, fold_path
from ddtree_server.kernels.gdn_norm import gated_norm
from ddtree_server.models.hybrid import delta, gdn_fast
from ddtree_server.models.hybrid.cache import HybridCache
from ddtree_server.models.hybrid.config import HybridConfig
from ddtree_server.models.hybrid.gdn import GatedDeltaNet, GatedRMSNorm
from ddtree_server.models.hybrid.graphs import GraphedHybrid
from ddtree_server.models.hybrid.tree import tree_meta
from tests.server import hybrid_fixtures
from tests.server.hybrid_fixtures import tiny_config
from tests.server.test_hybrid_tree import ancestors, random_tree

def kernels():

    torch.manual_seed(0)
    out = {}
    def err(a, b):
        a, b = a.float(), b.float()
        return ((a - b).abs() / (1 + b.abs())).max().item()

    # pre: conv windows (chain, tree), G across two row blocks, conv rows / committed state written
    cfg = HybridConfig.from_any(tiny_config("3gdn+attn").to_dict())
    for dtype in (torch.float32, torch.float16):
        mixer = GatedDeltaNet(cfg)
        with torch.no_grad():
            for p in mixer.parameters():
                p.normal_()
            mixer.A_log.uniform_(-1, 2)
        mixer = mixer.to(dtype)
        cache = HybridCache(cfg, "chunk", 64, 24, dtype, torch.device("cpu"))
        cache.conv[:, :3] = torch.randn_like(cache.conv[:, :3])
        rep = mixer.hv // mixer.hk
        for n, commit in ((1, True), (1, False), (24, False)):
            parents = random_tree(n, 16, random.Random(n), "bushy")
            meta = tree_meta(None if commit else ancestors(parents), n, 4, "cpu")
            proj = (torch.randn(n, mixer.in_proj.out_features) * 2).to(dtype)
            conv0 = cache.conv.clone()
            q, k, v, g, beta, z, ext = mixer.prepare(proj, cache, 1, meta)
            rows, state = cache.inputs[1, :n].clone(), ext.index_select(0, meta.win[n - 1, 1:]).clone()
            cache.conv.copy_(conv0)
            cache.inputs.zero_()
            G = torch.zeros(24, mixer.hv)
            q2, k2, v2, b2 = gdn_pre(proj, cache.conv[1], meta.win, meta.anc, mixer.conv1d.weight[:, 0, :], mixer.A_log,
                                     mixer.dt_bias, (mixer.hk, mixer.hv, mixer.dk, mixer.dv), G, store_rows=not commit,
                                     commit=commit, rows=cache.inputs[1])
            conv = err(cache.conv[1, :3], state) if commit else max(err(cache.conv[1], conv0[1]),
                                                                      err(cache.inputs[1, :n], rows))
            out[f"pre/{str(dtype)[6:]}/{n}/{commit}"] = max(
                err(q2.repeat_interleave(rep, 1), q), err(k2.repeat_interleave(rep, 1), k), err(v2, v), err(b2, beta),
                err(G[:n], meta.anc.float() @ g) * 1e-2, conv)  # G: sums of up to 17 gates of size ~50

    # the rule: tree-masked chunk (several shapes, depth <= 16, padded rows), fold, step
    for hk, hv, dk, dv in ((2, 4, 8, 12), (1, 3, 16, 40)):
        rep = hv // hk
        s0 = torch.randn(hv, dk, dv) * 0.3
        cases = (("chain", 1, 1), ("chain", 17, 17), ("star", 17, 17), ("bushy", 33, 33), ("deep", 65, 65),
                 ("bushy", 80, 65))  # 80 rows: a 65-node tree padded as in the 80-row CUDA graph
        for shape, n, real in (cases if hk == 2 else cases[1::2]):  # second shape: 3 V tiles, one partial
            rng = random.Random(n)
            anc = torch.eye(n, dtype=torch.bool)
            anc[:real, :real] = ancestors(random_tree(real, 16, rng, shape))
            q = torch.nn.functional.normalize(torch.randn(n, hk, dk), dim=-1) * dk ** -0.5
            k = torch.nn.functional.normalize(torch.randn(n, hk, dk), dim=-1)
            v, g, beta = torch.randn(n, hv, dv), -torch.rand(n, hv) * 2, torch.rand(n, hv)
            G = anc.float() @ g
            kk, uu = torch.zeros(n, hv, dk), torch.zeros(n, hv, dv)
            o = tree_rule(q, k, v, G, beta, s0, anc, kk, uu)
            kr = k.repeat_interleave(rep, 1)
            o2, u2, _ = delta.tree_chunk(q.repeat_interleave(rep, 1), kr, v, g, beta, s0, anc)
            key = f"{hk}x{hv}x{dk}x{dv}/{shape}/{n}"
            out["tree/" + key] = max(err(o, o2), err(uu, u2), err(kk, kr))
            path = anc[rng.randrange(real)].nonzero()[:, 0]
            S, KK, UU, GG = torch.stack([s0, -s0]), torch.stack([kk, kk]), torch.stack([uu, uu * 0.5]), torch.stack([G, G])
            want = delta.fold(S, KK.index_select(1, path), UU.index_select(1, path), GG.index_select(1, path))
            fold_path(S, KK, UU, GG, path)
            out["fold/" + key] = err(S, want)
        S = s0.clone()
        q, k = (torch.nn.functional.normalize(torch.randn(1, hk, dk), dim=-1) for _ in range(2))
        v, g, beta = torch.randn(1, hv, dv), -torch.rand(1, hv), torch.rand(1, hv)
        o = step_rule(q, k, v, g, beta, S)
        o2, s2 = delta.step(q.repeat_interleave(rep, 1)[0], k.repeat_interleave(rep, 1)[0], v[0], g[0], beta[0], s0)
        out[f"step/{hk}x{hv}x{dk}x{dv}"] = max(err(o, o2), err(S, s2))

    # gated RMSNorm (z a strided view of the projection)
    for dtype in (torch.float32, torch.float16):
        norm = GatedRMSNorm(12, 1e-6)
        with torch.no_grad():
            norm.weight.normal_()
        norm = norm.to(dtype)
        o, proj = torch.randn(5, 4, 12), torch.randn(5, 100).to(dtype)
        z = proj[:, 10:58]
        out[f"norm/{str(dtype)[6:]}"] = err(gated_norm(o, z, norm.weight, norm.eps), norm(o, z.view(5, 4, 12)).reshape(5, -1))

    errors = {}
    for name, call in {"tree_shape": lambda: tree_rule(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), torch.zeros(3, 3, 8),
                                                       torch.zeros(3, 3), torch.zeros(3, 3), torch.zeros(3, 8, 8),
                                                       torch.ones(3, 3, dtype=torch.bool), torch.zeros(3, 3, 8),
                                                       torch.zeros(3, 3, 8)),
                       "pre_commit": lambda: gdn_pre(torch.zeros(2, 8), torch.zeros(5, 4), torch.zeros(2, 4, dtype=torch.long),
                                                     torch.ones(2, 2, dtype=torch.bool), torch.zeros(4, 4), torch.zeros(1),
                                                     torch.zeros(1), (1, 1, 1, 2), torch.zeros(2, 1), commit=True),
                       "fold_empty": lambda: fold_path(torch.zeros(1, 2, 4, 4), torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4),
                                                       torch.zeros(1, 3, 2), torch.zeros(0, dtype=torch.long))}.items():
        try:
            call()
        except ValueError as exc:
            errors[name] = str(exc)
    return {"results": out, "errors": errors}


def wiring():

    torch.set_num_threads(1)
    hybrid_fixtures.PATTERNS["gdn-attn-gdn"] = ["linear_attention", "full_attention", "linear_attention"]
    model = hybrid_fixtures.tiny_hybrid_ours("gdn-attn-gdn", seed=3)
    caches = {f: model.new_cache(128, tree_rows=16) for f in "01"}
    res = {"logits": [], "state": []}
    def both(ids, pos, mask=None, path=None):
        outs = {}
        for f in "01":
            os.environ["DDTREE_KERNELS"] = f
            start = caches[f].length
            outs[f] = model.forward(caches[f], ids, pos, tree_mask=mask)[0]
            if path is not None:
                caches[f].keep(start, path)
        res["logits"].append((outs["1"] - outs["0"]).abs().max().item())
        if path is not None:
            res["state"].append((caches["1"].state - caches["0"].state).abs().max().item())
    with torch.no_grad():
        both(torch.randint(0, 250, (9,)), torch.arange(9))                        # pending chain, settled by a fold
        both(torch.randint(0, 250, (1,)), torch.tensor([9]))                      # decode step, state in place
        parents = random_tree(9, 16, random.Random(1), "bushy")
        anc = ancestors(parents)
        leaf = max(range(9), key=lambda i: (anc[i].sum().item(), i))
        path = anc[leaf].nonzero()[:, 0].tolist()
        both(torch.randint(0, 250, (9,)), anc.sum(1) - 1 + 10, anc, path)        # tree verify + keep
        s = 10 + len(path)
        both(torch.randint(0, 250, (1,)), torch.tensor([s]))
        both(torch.randint(0, 250, (9,)), torch.arange(s + 1, s + 10), None, [0, 1, 2])  # DFlash-like block + keep
        graphed = GraphedHybrid(model, capture=False)  # the static graph path; graphs dropped on a failure
        gcache = graphed.new_cache(64)
        graphed.forward(gcache, torch.tensor([5]), torch.tensor([0]))
        before = list(graphed._static.values())
        res["checked"] = sorted(k[0] for k in gdn_fast._checked)
        res["failed_before"] = list(gdn_fast._failed)
        # a broken kernel: the self-check keeps the torch result and turns the kernels off
        gdn_fast._checked.clear()
        good = gdn_tree.tree_rule
        gdn_tree.tree_rule = lambda *a, **kw: good(*a, **kw) * 1.5
        records = []
        logging.getLogger("ddtree_server.models.hybrid.gdn_fast").addHandler(
            type("H", (logging.Handler,), {"emit": lambda self, r: records.append(r.getMessage())})())
        s = caches["0"].length
        anc = ancestors(random_tree(9, 16, random.Random(2), "deep"))
        both(torch.randint(0, 250, (9,)), anc.sum(1) - 1 + s, anc, [0, 1])
        res["failed_after"] = list(gdn_fast._failed)
        res["warnings"] = records
        os.environ["DDTREE_KERNELS"] = "1"
        res["usable_after"] = gdn_fast.fold_usable(caches["1"])
        graphed.forward(gcache, torch.tensor([6]), torch.tensor([1]))
        res["graphs_dropped"] = all(st not in before for st in graphed._static.values()) and len(before) == 1
        gdn_tree.tree_rule = good
    return res


PARTS = {"kernels": kernels, "wiring": wiring}
"""


child = module_child(_CHILD, DDTREE_KERNELS="1")   # one interpreter child for the module's parts


def test_gdn_kernels_match_torch_references(child):
    report = child("kernels")
    res = report["results"]
    assert len(res) == 6 + 2 * (6 + 3) + 2 + 2  # pre (2 dtypes x 3), tree + fold (6 + 3 trees), step, norm
    for name, e in res.items():
        tol = 1e-3 if "float16" in name and name.startswith("norm") else 1e-5  # fp16 output: 1 ulp
        assert e <= tol, (name, e)
    assert set(report["errors"]) == {"tree_shape", "pre_commit", "fold_empty"}


def test_gdn_kernel_path_equals_torch_path_and_falls_back_on_a_bad_kernel(child):
    res = child("wiring")
    assert len(res["logits"]) == 6 and max(res["logits"]) <= 1e-4, res["logits"]
    assert max(res["state"]) <= 1e-5, res["state"]
    assert res["failed_before"] == [] and {"commit", "chunk", "fold"} <= set(res["checked"])
    # the injected bug: caught at its first call, torch result kept (same logits), kernels off
    assert res["logits"][-1] <= 1e-4 and res["state"][-1] <= 1e-5
    assert len(res["failed_after"]) == 1 and "self-check" in res["failed_after"][0]
    assert any("GDN kernels disabled" in w for w in res["warnings"])
    assert res["usable_after"] is False and res["graphs_dropped"] is True


def test_gdn_kernels_compile_for_hopper():
    """Every launch the wrappers make (Qwen3.6-27B shape, bf16 and fp32) compiles for sm_90."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from tests.server.gdn_launches import compile_all

    compiled = compile_all()
    assert len(compiled) >= 8, compiled
