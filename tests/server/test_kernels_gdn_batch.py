"""kernels/gdn_batch.py and gdn_batch_tree.py under TRITON_INTERPRET=1 (CPU, fp32): the GDN decode
step and the pending blocks (chains, trees) of several requests on their slots of a pooled hybrid
cache (the verify scratch: the round's, one for all slots, each block's rows at its row offset).
Each request's output rows and what it writes (recurrent / conv state; conv rows and the
verify scratch) are bitwise those of (a) the same request alone in the batched kernels and (b) the
one-request kernel path (``gdn_fast.fused`` on its slot's cache); other slots are untouched; the
rows are close to the pure-torch ``step_torch`` / ``chunk_torch``; and the engine's entry points
(``gdn_batch.step`` / ``chunk``) self-check and then take the kernels. The interpreter must be chosen before
triton is imported: the kernels run in one child process for the module (interp_child.py)."""

from __future__ import annotations

import pytest

from tests.server.interp_child import module_child

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels

_CHILD = r"""
import os, random, torch
from tests.server.interp_fast import install
install()
from types import SimpleNamespace
from ddtree_server.engine.batch.pools import SlotPool
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams
from ddtree_server.models.drafter.config import DrafterConfig
from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.hybrid import gdn_batch, gdn_fast
from ddtree_server.models.hybrid.gdn_groups import RowGroups
from ddtree_server.models.hybrid.tree import tree_meta
from tests.server.batch_fixtures import run_together
from tests.server.hybrid_fixtures import tiny_hybrid
from tests.server.tiny import EOS, ByteTokenizer

def step():

    torch.manual_seed(0)
    model = tiny_hybrid("3gdn+attn", seed=3)
    mixer, li = model.layers[1].linear_attn, 1
    pool = SlotPool(lambda: model.new_cache(32), 6)
    for name in ("state", "conv"):
        pool.pool(name).copy_(0.5 * torch.randn(pool.pool(name).shape))
    slots = torch.tensor([3, 0, 5, 2])
    proj = torch.randn(4, mixer.in_proj.out_features)
    names = ("conv", "state")
    fresh = lambda: {n: pool.pool(n).clone() for n in names}
    start = fresh()

    def run(fn):
        for n in names:
            pool.pool(n).copy_(start[n])
        out = fn()
        return out, fresh()

    views = lambda g: (g["conv"][:, li], g["state"][:, li])
    batched, after = run(lambda: gdn_batch.step_fused(mixer, proj, *views({n: pool.pool(n) for n in names}), slots))
    ref, after_ref = run(lambda: gdn_batch.step_torch(mixer, proj, *views({n: pool.pool(n) for n in names}), slots))
    res = {"alone": [], "solo_path": [], "err": float((batched - ref).abs().max()),
           "state_err": float((after["state"] - after_ref["state"]).abs().max()),
           "conv_equal": bool(torch.equal(after["conv"], after_ref["conv"])),
           "untouched": bool(torch.equal(after["state"][[1, 4]], start["state"][[1, 4]]))}
    for i, s in enumerate(slots.tolist()):
        one, a1 = run(lambda: gdn_batch.step_fused(mixer, proj[i:i + 1], *views({n: pool.pool(n) for n in names}),
                                                   slots[i:i + 1]))
        res["alone"].append(bool(torch.equal(one, batched[i:i + 1])) and bool(torch.equal(a1["state"][s], after["state"][s]))
                            and bool(torch.equal(a1["conv"][s], after["conv"][s])))
        ctx = SimpleNamespace(meta=tree_meta(None, 1, mixer.kernel, proj.device), mode="commit")
        solo, a2 = run(lambda: gdn_fast.fused(mixer, proj[i:i + 1], pool[s], li, ctx))
        k1 = mixer.kernel - 1
        res["solo_path"].append(bool(torch.equal(solo, batched[i:i + 1])) and bool(torch.equal(a2["state"][s], after["state"][s]))
                                and bool(torch.equal(a2["conv"][s, :, :k1], after["conv"][s, :, :k1])))
    entry, a3 = run(lambda: gdn_batch.step(mixer, proj, {n: pool.pool(n) for n in names}, li, slots))
    again, a4 = run(lambda: gdn_batch.step(mixer, proj, {n: pool.pool(n) for n in names}, li, slots))
    res["entry"] = [bool(torch.equal(again, batched)), bool(torch.equal(a4["state"], after["state"])),
                    gdn_fast.kernels_on(proj.device), float((entry - ref).abs().max())]
    return res


def tree():

    torch.manual_seed(0)
    model = tiny_hybrid("3gdn+attn", seed=3)
    mixer, li = model.layers[2].linear_attn, 2
    scr = model.new_scratch(64)   # the round's verify scratch, shared by the slots
    pool = SlotPool(lambda: model.new_cache(48, tree_rows=24, scratch=scr), 6)
    names = ("conv", "state", "kk", "uu", "GG", "inputs")
    T = lambda n: pool.pool(n) if n in ("conv", "state") else getattr(scr, n)
    for name in ("state", "conv"):
        pool.pool(name).copy_(0.5 * torch.randn(pool.pool(name).shape))
    rng = random.Random(1)
    def tree(n):
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            if i:
                anc[i] = anc[rng.randrange(i)]
            anc[i, i] = True
        return anc
    blocks = [(4, None, 5), (1, tree(17), 17), (3, None, 2), (0, tree(7), 7)]   # (slot, mask, rows)
    metas = [tree_meta(m, n, mixer.kernel, torch.device("cpu")) for _, m, n in blocks]
    def group(sel):
        offs = [0]
        for i in sel:
            offs.append(offs[-1] + blocks[i][2])
        masks = [None if blocks[i][1] is None else blocks[i][1].numpy() for i in sel]
        return RowGroups(offs, [blocks[i][0] for i in sel], ["chunk"] * len(sel), masks, mixer.kernel,
                         torch.device("cpu")).chunks
    m_all = sum(n for _, _, n in blocks)
    proj = torch.randn(m_all, mixer.in_proj.out_features)
    start = {n: T(n).clone() for n in names}
    def run(fn):
        for n in names:
            T(n).copy_(start[n])
        out = fn()
        return out, {n: T(n).clone() for n in names}
    views = lambda: [T(n)[:, li] for n in ("conv", "state")] + [T(n)[li] for n in ("kk", "uu", "GG", "inputs")]
    ch = group([0, 1, 2, 3])
    batched, after = run(lambda: gdn_batch.chunk_fused(mixer, proj, *views(), ch))
    ref, after_ref = run(lambda: gdn_batch.chunk_torch(mixer, proj, *views(), ch))
    res = {"alone": [], "solo_path": [], "err": float((batched - ref).abs().max())}
    k1 = mixer.kernel - 1
    def rows_of(a, s, b0, n):   # what a block writes: its rows b0.. of the scratch (its slot's conv: nothing)
        return [a["inputs"][li, b0:b0 + n], a["kk"][li, b0:b0 + n], a["uu"][li, b0:b0 + n], a["GG"][li, b0:b0 + n],
                a["conv"][s]]
    offs = [sum(n for _, _, n in blocks[:i]) for i in range(len(blocks))]   # each block's row offset in the round
    res["scratch_err"] = max(float((x - y).abs().max()) for (s, _, n), b0 in zip(blocks, offs)
                             for x, y in zip(rows_of(after, s, b0, n), rows_of(after_ref, s, b0, n)))
    res["untouched"] = bool(torch.equal(after["state"], start["state"])) and bool(torch.equal(after["conv"], start["conv"]))
    off = 0
    for i, (s, mask, n) in enumerate(blocks):
        one, a1 = run(lambda: gdn_batch.chunk_fused(mixer, proj[off:off + n], *views(), group([i])))
        res["alone"].append(bool(torch.equal(one, batched[off:off + n]))
                            and all(bool(torch.equal(x, y)) for x, y in zip(rows_of(a1, s, 0, n), rows_of(after, s, off, n))))
        cache = pool[s]
        cache.win[:n] = metas[i].win
        anc = metas[i].anc
        ctx = SimpleNamespace(meta=metas[i], mode="chunk")
        solo, a2 = run(lambda: gdn_fast.fused(mixer, proj[off:off + n], cache, li, ctx))
        res["solo_path"].append(bool(torch.equal(solo, batched[off:off + n]))
                                and all(bool(torch.equal(x, y)) for x, y in zip(rows_of(a2, s, 0, n), rows_of(after, s, off, n))))
        off += n
    gdn = {n: T(n) for n in names}
    entry, _ = run(lambda: gdn_batch.chunk(mixer, proj, gdn, li, ch))
    again, a4 = run(lambda: gdn_batch.chunk(mixer, proj, gdn, li, ch))
    res["entry"] = [bool(torch.equal(again, batched)), gdn_fast.kernels_on(proj.device), float((entry - ref).abs().max())]
    return res


def engine():
    torch.set_num_threads(1)
    t = tiny_hybrid("2gdn+attn", seed=21)   # two GDN layers: the layer index of the pooled state varies
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 4,
           "dflash_config": {"mask_token_id": 257, "target_layer_ids": [1, 2]}, "num_hidden_layers": 1,
           "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 260, "rope_theta": 10000.0}
    torch.manual_seed(1)
    d = DFlashDrafter(DrafterConfig.from_dict(raw), t.embed_tokens, t.lm_head).eval()
    jobs = [(list(b"abc def"), "ar"), (list(b"hello hello"), "ddtree"), (list(b"xy"), "dflash"), (list(b"zz top"), "ar")]
    p = lambda: SamplingParams(max_tokens=5, ignore_eos=True)   # 5 rounds: state carried over 4 (at 4 a state-fold fault showed on the last token only)
    out = {}
    for padded in ("0", "1"):   # the eager batched layout, then the padded layout of the CUDA graphs (run eagerly)
        os.environ["DDTREE_BATCH_GRAPHS"] = padded
        eng = Engine(t, ByteTokenizer(), d, eos_token_ids=[EOS], max_model_len=64, max_running=4)
        if "alone" not in out:   # solo rounds take the one-request kernels whatever the layout
            out["alone"] = [[x for ev in eng.generate(ids, p(), mode=m) for x in ev.token_ids] for ids, m in jobs]
        batched, sizes = run_together(eng, jobs, p)
        g = eng.batch.runner.graphs
        out[padded] = {"batched": batched, "max_batch": max(sizes), "rounds": len(sizes),
                       "pending_rounds": g.pending_rounds if g is not None else 0}
    os.environ.pop("DDTREE_BATCH_GRAPHS")
    out["kernels"] = gdn_fast.kernels_on(torch.device("cpu"))
    return out


PARTS = {"step": step, "tree": tree, "engine": engine}
"""


child = module_child(_CHILD, DDTREE_KERNELS="1")   # one interpreter child for the module's parts


def test_batched_step_kernels_are_batch_invariant_and_match_torch(child):
    res = child("step")
    assert all(res["alone"]) and len(res["alone"]) == 4, res
    assert all(res["solo_path"]), res
    assert res["err"] < 1e-5 and res["state_err"] < 1e-5 and res["conv_equal"] and res["untouched"], res
    assert res["entry"][:3] == [True, True, True] and res["entry"][3] < 1e-5, res


def test_batched_tree_kernels_are_batch_invariant_and_match_torch(child):
    res = child("tree")
    assert all(res["alone"]) and len(res["alone"]) == 4, res
    assert all(res["solo_path"]), res
    assert res["err"] < 1e-5 and res["scratch_err"] < 1e-5 and res["untouched"], res
    assert res["entry"][:2] == [True, True] and res["entry"][2] < 1e-5, res


@pytest.mark.slow
def test_hybrid_engine_batched_on_the_kernel_path_equals_alone(child):
    """The batch engine on a tiny hybrid with the Triton kernels on (interpreter): rounds of plain
    rows, chains and trees together (the batched GDN kernels, self-checked) give each request the
    tokens of its solo rounds (the one-request kernels), and the kernels stay on; in the eager
    batched layout and in the padded layout of the CUDA graphs (DDTREE_BATCH_GRAPHS=1, eager here:
    every block of a round with drafts pending, padding chains sharing the scratch slot). One
    child process for both (the interpreter's set-up and the solo rounds once)."""
    doc = child("engine")
    assert doc["kernels"] and all(len(a) == 5 for a in doc["alone"])
    for padded in ("0", "1"):
        got = doc[padded]
        assert got["max_batch"] == 4 and got["rounds"] == 5 and got["batched"] == doc["alone"], (padded, got)
        assert (got["pending_rounds"] > 0) == (padded == "1"), (padded, got)


def _compile(fn, types: dict, consts: dict, **options):
    """Compile for an H100 / H200 (sm_90) on the CPU (Triton's bundled ptxas), as test_kernels_compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {name: types.get(name, "i32") for name in fn.arg_names}
    sig.update({name: "constexpr" for name in consts})
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=options)


def test_batched_gdn_kernels_compile_for_sm90_at_the_27b_shape():
    """bf16 projections and conv state, fp32 rule (Qwen3.6-27B: Hk 16, Hv 48, Dk = Dv = 128, K 4)."""
    from ddtree_server.kernels import gdn_batch, gdn_batch_tree

    dims = {"HK": 16, "HV": 48, "DK": 128, "DV": 128}
    f32 = {n: "*fp32" for n in ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "s_ptr", "o_ptr", "kk_ptr", "a_ptr",
                               "p_ptr", "d_ptr", "u_ptr")}
    low = {n: "*bf16" for n in ("proj_ptr", "conv_ptr", "w_ptr", "alog_ptr", "dtb_ptr", "in_ptr")}
    idx = {n: "*i64" for n in ("slot_ptr", "slots_ptr", "local_ptr", "req_ptr", "qo_ptr", "win_ptr", "base_ptr")}
    types = {**f32, **low, **idx, "anc_ptr": "*u8", "scale": "fp32"}
    _compile(gdn_batch._pre_kernel, types, {**dims, "KW": 4, "BC": 128}, num_warps=1)
    _compile(gdn_batch._state_kernel, types, {**dims, "BK": 128, "BV": 32}, num_warps=4)
    _compile(gdn_batch_tree._pre_rows_kernel, types, {**dims, "KW": 4, "BC": 128}, num_warps=1)
    _compile(gdn_batch_tree._prep_kernel, types, {"HK": 16, "HV": 48, "DK": 128, "BK": 128, "PREC": "ieee"},
             num_warps=4)
    _compile(gdn_batch_tree._solve_kernel, types, {**dims, "BK": 128, "BV": 16, "PREC": "ieee"}, num_warps=8)
