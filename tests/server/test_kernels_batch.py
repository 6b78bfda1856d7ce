"""kernels/attention_batch.py under TRITON_INTERPRET=1 (CPU): every request's attention rows in one
batched launch are bitwise those of the one-request kernel on its slot (batch invariance), for
causal blocks and tree masks, fp32 and fp16 (bf16 on the GPU), with several key splits, read from
the slot pool or through page tables; and close to the torch reference. The interpreter must be chosen before triton is imported: the kernels run in one child
process for the module (interp_child.py)."""

from __future__ import annotations

import pytest

from tests.server.interp_child import module_child

pytest.importorskip("triton")

_CHILD = r"""
import torch
from tests.server.interp_fast import install
install()
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams
from ddtree_server.kernels import attention as A
from ddtree_server.kernels.attention_batch import batch_attention
from ddtree_server.models.drafter.config import DrafterConfig
from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.layers import kernels_usable
from tests.server.batch_fixtures import run_together
from tests.server.tiny import EOS, VOCAB, ByteTokenizer, tiny_target

def kernels():
    torch.manual_seed(0)
    cfg = A.AttnConfig(block_m=16, block_n=16, max_splits=4)
    out = []
    for dtype in (torch.float32, torch.float16):   # the interpreter has no bf16 dot
        slots, hkv, rep, d, rows = 4, 2, 2, 16, 160
        k = torch.randn(slots, hkv, rows, d).to(dtype)
        v = torch.randn(slots, hkv, rows, d).to(dtype)
        reqs = [(2, 37, 1), (0, 70, 5), (3, 130, 3), (1, 5, 4)]   # (slot, start, rows)
        n_max = max(n for _, _, n in reqs)
        # the same rows in a page pool: pages of 16 rows in a random order, page 0 the dummy (NaN:
        # a read of it would show), each request's table the pages of its slot
        per = rows // 16
        perm = torch.randperm(slots * per) + 1
        kp = torch.full((slots * per + 1, hkv, 16, d), float("nan")).to(dtype)
        vp = kp.clone()
        kp[perm] = k.view(slots, hkv, per, 16, d).transpose(1, 2).reshape(-1, hkv, 16, d)
        vp[perm] = v.view(slots, hkv, per, 16, d).transpose(1, 2).reshape(-1, hkv, 16, d)
        table = perm.view(slots, per)[[sl for sl, _, _ in reqs]].to(torch.int32)
        for mode in ("causal", "tree"):
            blocks = torch.zeros(len(reqs), n_max, n_max, dtype=torch.bool)
            for i, (_, _, n) in enumerate(reqs):
                m = torch.ones(n, n, dtype=torch.bool).tril_()
                if mode == "tree" and n > 2:
                    m[n - 1, n - 2] = False   # a sibling of the previous node
                blocks[i, :n, :n] = m
            q = torch.randn(sum(n for _, _, n in reqs), hkv * rep, d).to(dtype)
            qo = torch.tensor([0] + [sum(n for _, _, n in reqs[:i + 1]) for i in range(len(reqs))])
            got = batch_attention(q, k, v, torch.tensor([s for _, s, _ in reqs]), qo, torch.tensor([sl for sl, _, _ in reqs]),
                                  n_max, mode, blocks if mode == "tree" else None, config=cfg)
            paged = batch_attention(q, kp, vp, torch.tensor([s for _, s, _ in reqs]), qo, torch.zeros(len(reqs), dtype=torch.long),
                                    n_max, mode, blocks if mode == "tree" else None, config=cfg, pages=table)
            for i, (sl, s, n) in enumerate(reqs):
                rows_q = q[qo[i]:qo[i + 1]]
                blk = blocks[i, :n, :n].contiguous() if mode == "tree" else None
                alone = A.decode_attention(rows_q, k[sl], v[sl], torch.tensor(s), mode, blk, config=cfg)
                ref = A.attention_ref(rows_q, k[sl], v[sl], s, mode, blk)
                out.append({"dtype": str(dtype), "mode": mode, "req": i,
                            "bitwise": bool(torch.equal(got[qo[i]:qo[i + 1]], alone)),
                            "paged": bool(torch.equal(paged[qo[i]:qo[i + 1]], alone)),
                            "err": float((got[qo[i]:qo[i + 1]].float() - ref.float()).abs().max()),
                            "splits": A.plan(n, rep, hkv, d, rows, q.device, cfg)[2]})
    return out


def engine():
    torch.set_num_threads(1)
    t = tiny_target(layers=3)   # the fewest a drafter reading layers [1, 2] allows
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 4,
           "dflash_config": {"mask_token_id": 257, "target_layer_ids": [1, 2]}, "num_hidden_layers": 1,
           "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 10000.0}
    torch.manual_seed(1)
    d = DFlashDrafter(DrafterConfig.from_dict(raw), t.embed_tokens, t.lm_head).eval()
    eng = Engine(t, ByteTokenizer(), d, eos_token_ids=[EOS], max_model_len=64, max_running=3)
    jobs = [(list(b"abc def"), "ar"), (list(b"hello hello"), "ddtree"), (list(b"xy"), "dflash")]
    p = lambda: SamplingParams(max_tokens=4, ignore_eos=True)   # 4 rounds: the K/V carried over 3
    alone = [[x for ev in eng.generate(ids, p(), mode=m) for x in ev.token_ids] for ids, m in jobs]
    batched, sizes = run_together(eng, jobs, p)
    # the paged layout: every round batched (qkv_prep_rows writes each row to its page row)
    paged = Engine(t, ByteTokenizer(), d, eos_token_ids=[EOS], max_model_len=64, max_running=3,
                   kv_layout="paged", kv_pages=24)
    on_pages, _ = run_together(paged, jobs, p)
    return {"alone": alone, "batched": batched, "paged": on_pages, "max_batch": max(sizes), "rounds": len(sizes),
            "kernels": kernels_usable(16, t.embed_tokens.weight)}


def windows():
    # block mode and sliding windows (a DFlash draft block's attention) against a dense masked
    # reference: every request's rows over its slot, several key splits
    torch.manual_seed(2)
    cfg = A.AttnConfig(block_m=16, block_n=16, max_splits=4)
    slots, hkv, rep, d, rows, n = 4, 2, 2, 16, 160, 4
    k, v = torch.randn(slots, hkv, rows, d), torch.randn(slots, hkv, rows, d)
    reqs = [(2, 37), (0, 70), (3, 130), (1, 3)]   # (slot, start): n new rows after start
    q = torch.randn(len(reqs) * n, hkv * rep, d)
    qo = torch.arange(0, (len(reqs) + 1) * n, n)
    out = []
    for mode, window in (("block", None), ("causal", 20), ("block", 20), ("causal", 1), ("block", 5), ("block", 2)):
        got = batch_attention(q, k, v, torch.tensor([s for _, s in reqs]), qo, torch.tensor([sl for sl, _ in reqs]),
                              n, mode, config=cfg, window=window)
        for i, (sl, s) in enumerate(reqs):
            qp = torch.arange(s, s + n)[:, None]
            kp = torch.arange(s + n)[None, :]
            see = (kp <= qp) if mode == "causal" else torch.ones(n, s + n, dtype=torch.bool)
            if window is not None:
                see &= (qp - kp < window) & ((kp - qp < window) | (mode == "causal"))
            kk = k[sl, :, :s + n].repeat_interleave(rep, 0)
            vv = v[sl, :, :s + n].repeat_interleave(rep, 0)
            att = torch.einsum("nhd,hkd->hnk", q[qo[i]:qo[i + 1]], kk) * d ** -0.5
            ref = torch.einsum("hnk,hkd->nhd", att.masked_fill(~see, float("-inf")).softmax(-1), vv)
            out.append({"mode": mode, "window": window, "req": i,
                        "err": float((got[qo[i]:qo[i + 1]] - ref).abs().max()),
                        "splits": A.plan(n, rep, hkv, d, rows, q.device, cfg)[2]})
    return out


def drafter():
    # the batched drafter (propose_batch) on the kernel path against each request's own propose
    # (masked SDPA over its cache): a sliding layer (window 6) and a full layer
    from ddtree_server.engine.batch.draft import propose_batch
    from ddtree_server.engine.batch.pools import SlotPool
    from tests.server.batch_fixtures import real_drafter
    torch.manual_seed(3)
    d = real_drafter(tiny_target(layers=3), block=4, window=6)
    pool = SlotPool(lambda: d.new_cache(96), 4, pooled=True)
    lens, width = [3, 9, 20, 41], 2 * 64
    ctxs = [torch.randn(n, width) for n in lens]
    refs = [d.propose(d.new_cache(96), c, 7 + i, n) for i, (c, n) in enumerate(zip(ctxs, lens))]
    slots = [2, 0, 3, 1]
    got = propose_batch(d, pool.pool("k"), pool.pool("v"), [pool[s] for s in slots], slots, ctxs,
                        [7 + i for i in range(4)], lens)
    # the same through page tables (the target's page ids, shuffled): pages 1 .. 28, 7 per slot
    from ddtree_server.engine.batch.paged_draft import DraftPages
    tables = torch.zeros((5, 7), dtype=torch.int32)
    tables[:4] = (torch.randperm(28, generator=torch.Generator().manual_seed(4)) + 1).view(4, 7).to(torch.int32)
    pages = DraftPages(d.config, 29, 4, 96, tables, d.dtype, "cpu")
    paged = propose_batch(d, pages.pool("k"), pages.pool("v"), [pages[s] for s in slots], slots, ctxs,
                          [7 + i for i in range(4)], lens, tables)
    return {"kernels": kernels_usable(16, pool.pool("k")), "err": float((got - torch.stack(refs)).abs().max()),
            "scale": float(torch.stack(refs).abs().max()), "paged": float((paged - got).abs().max())}


PARTS = {"kernels": kernels, "engine": engine, "windows": windows, "drafter": drafter}
"""


child = module_child(_CHILD, DDTREE_KERNELS="1")   # one interpreter child for the module's parts


@pytest.fixture(scope="module")
def report(child):
    return child("kernels")


@pytest.mark.kernels   # the Triton interpreter: not in `make test-fast`
def test_batched_rows_equal_one_request_bitwise(report):
    assert len(report) == 16 and all(r["bitwise"] for r in report), [r for r in report if not r["bitwise"]]
    assert max(r["splits"] for r in report) > 1   # the merge of several key splits is exercised


@pytest.mark.kernels   # the Triton interpreter: not in `make test-fast`
def test_paged_rows_equal_the_slot_pool_bitwise(report):
    """The same rows read through page tables (pages of 16 in a random order) give the bits of
    the slot pool: addresses change, tiles and splits do not."""
    assert len(report) == 16 and all(r["paged"] for r in report), [r for r in report if not r["paged"]]


@pytest.mark.kernels   # the Triton interpreter: not in `make test-fast`
def test_batched_rows_match_reference(report):
    for r in report:
        assert r["err"] < (2e-5 if r["dtype"] == "torch.float32" else 3e-3), r


@pytest.mark.kernels   # the Triton interpreter: not in `make test-fast`
def test_block_mode_and_windows_match_reference(child):
    """A DFlash draft block's attention (every new row sees all new rows) and sliding windows
    (causal and not; a window of 1 sees only its own key) over each request's slot."""
    report = child("windows")
    assert len(report) == 24 and max(r["splits"] for r in report) > 1
    for r in report:
        assert r["err"] < 2e-5, r


@pytest.mark.kernels   # the Triton interpreter: not in `make test-fast`
def test_batched_drafter_on_the_kernel_path_equals_its_solo_proposals(child):
    """Four requests' draft blocks in one forward through the batched kernel (slots out of order,
    lengths below, at and past the window) give each request's own proposal; on pages (the
    paged layout's drafter) the slot pool's bits."""
    doc = child("drafter")
    assert doc["kernels"], doc
    assert doc["err"] < 1e-4 * max(1.0, doc["scale"]), doc
    assert doc["paged"] == 0.0, doc   # through page tables: the kernel's tiles and splits, the same bits


@pytest.mark.slow
def test_engine_batched_on_the_kernel_path_equals_alone(child):
    """The batch engine with the Triton kernels on (interpreter): batched rounds (the batched
    attention kernel, the fused q/k-norm + RoPE + K/V writes per row) give each request the tokens
    of its solo rounds (the one-request kernels), on slots and on pages."""
    doc = child("engine")
    assert doc["kernels"] and doc["max_batch"] == 3 and all(len(a) == 4 for a in doc["alone"])
    assert doc["rounds"] == 4, doc
    assert doc["batched"] == doc["alone"] and doc["paged"] == doc["alone"]
