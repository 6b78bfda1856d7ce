"""The page pool's address variants of kernels/attention_batch.py (``DDTREE_PAGED_VARIANT`` 2 and 4,
kernels/attention_paged_kernels.py; the default picks among 0, 2, 4 by head dim and row blocks) under TRITON_INTERPRET=1 (CPU): every variant gives bitwise the
rows of variant 0 and of the slot pool (shuffled pages, page 0 and the unused pages NaN so a wrong
read shows), for one-row decoding, a 16-row causal block and tree, head dims 64 / 128 / 256 (tiles of
4 and of 2 pages), lengths off the tile and page grid, sliding windows, and the preload's
fall-back (ranges longer than the ids read up front). The GPU figures: bench/paged_attention.py
``--variants``."""

from __future__ import annotations

import pytest

from tests.server.interp_child import module_child

pytest.importorskip("triton")

_CHILD = r"""
import os
import torch
from tests.server.interp_fast import install
install()
from ddtree_server.kernels import attention as A
from ddtree_server.kernels.attention_batch import PAGED_VARIANTS, batch_attention

torch.set_num_threads(1)

def case(d, n, mode, starts, window=None, preload=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hkv, rep, rows = 2, 2, 336   # 21 pages of 16 per request
    cfg = A.AttnConfig(max_splits=3)   # a few key splits over the short contexts
    b = len(starts)
    k = torch.randn(b, hkv, rows, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, rows, d, generator=g).to(dtype)
    per = rows // 16
    perm = torch.randperm(b * per + 4, generator=g)[:b * per] + 1   # shuffled, a few pages unused
    kp = torch.full((b * per + 5, hkv, 16, d), float("nan")).to(dtype)
    vp = kp.clone()
    kp[perm] = k.view(b, hkv, per, 16, d).transpose(1, 2).reshape(-1, hkv, 16, d)
    vp[perm] = v.view(b, hkv, per, 16, d).transpose(1, 2).reshape(-1, hkv, 16, d)
    table = perm.view(b, per).to(torch.int32)
    q = torch.randn(b * n, hkv * rep, d, generator=g).to(dtype)
    qo = torch.arange(0, b * n + 1, n)
    start = torch.tensor(starts)
    blocks = None
    if mode == "tree":
        blocks = torch.ones(b, n, n, dtype=torch.bool).tril_()
        blocks[:, 5, 4] = False   # node 5 a sibling of node 4
        blocks[:, 9:, 4] = False
    slot = batch_attention(q, k, v, start, qo, torch.arange(b), n, mode, blocks, config=cfg, window=window)
    os.environ.pop("DDTREE_PAGED_PRELOAD", None)
    if preload:
        os.environ["DDTREE_PAGED_PRELOAD"] = str(preload)
    outs = {}
    for var in PAGED_VARIANTS:
        os.environ["DDTREE_PAGED_VARIANT"] = str(var)
        outs[var] = batch_attention(q, kp, vp, start, qo, torch.zeros(b, dtype=torch.long), n, mode, blocks,
                                    config=cfg, pages=table, window=window)
    os.environ.pop("DDTREE_PAGED_VARIANT")
    os.environ.pop("DDTREE_PAGED_PRELOAD", None)
    return {"splits": A.plan(n, rep, hkv, d, rows, "cpu", cfg)[2], "nan": bool(slot.isnan().any()),
            "slot": [bool(torch.equal(o, slot)) for o in outs.values()],
            "v0": [bool(torch.equal(o, outs[0])) for o in outs.values()]}

CASES = {
    "decode/d64": (64, 1, "causal", [37, 200, 5, 318]),
    "decode/d128/fp16": (128, 1, "causal", [130, 7, 255], None, None, torch.float16),
    "causal16/d128": (128, 16, "causal", [0, 61, 190]),
    "tree16/d64": (64, 16, "tree", [19, 250]),
    "decode/d256": (256, 1, "causal", [97, 300]),
    "window/d64": (64, 3, "causal", [150, 41, 300], 40),
    "block-window/d64": (64, 4, "block", [70, 211], 23),
    "fallback/d64": (64, 1, "causal", [300, 129], None, 4),   # one tile's ids read up front
    "fallback-tree/d128": (128, 16, "tree", [240], None, 4),
}

def run(name):
    return case(*CASES[name])

PARTS = {name: (lambda name=name: run(name)) for name in CASES}
"""

child = module_child(_CHILD, DDTREE_KERNELS="1")   # one interpreter child for the module's cases

_CASES = ("decode/d64", "decode/d128/fp16", "causal16/d128", "tree16/d64", "decode/d256", "window/d64",
          "block-window/d64", "fallback/d64", "fallback-tree/d128")


@pytest.mark.kernels   # the Triton interpreter: not in `make test-fast`
@pytest.mark.parametrize("name", _CASES)
def test_paged_variants_equal_variant_0_and_the_slot_pool_bitwise(child, name):
    r = child(name)
    assert not r["nan"] and r["splits"] > 1, r
    assert all(r["v0"]) and all(r["slot"]), r


def test_the_default_variant_follows_the_measured_cases(monkeypatch):
    """``default_variant``: variant 4 at 3 stages only for one row block of causal / block rows at
    head dim <= 128 on a GPU with the shared memory for it; tree masks and several row blocks keep
    variant 0; head dim 256 variant 2; the environment overrides (a sweep's knob)."""
    from ddtree_server.kernels import attention_batch as AB

    monkeypatch.setattr(AB, "_smem", lambda device: 227 << 10)
    assert AB.default_variant(128, "cuda", 2) == (4, 3)
    assert AB.default_variant(128, "cuda", 2, m_tiles=5) == (0, 2)
    assert AB.default_variant(128, "cuda", 2, tree=True) == (0, 2)
    assert AB.default_variant(256, "cuda", 2) == (2, 2)
    assert AB.default_variant(128, "cpu", 2) == (2, 2)
    assert AB.default_variant(128, "cuda", 2, elem=4) == (2, 2)   # 3 stages of fp32 tiles: too big for some
    monkeypatch.setattr(AB, "_smem", lambda device: 99 << 10)   # a GPU without room for 3 stages
    assert AB.default_variant(128, "cuda", 2) == (2, 2)
    monkeypatch.setenv("DDTREE_PAGED_VARIANT", "0")
    assert AB.paged_settings(16, 64, 2, 128, "cpu")[0] == 0
    monkeypatch.setenv("DDTREE_PAGED_VARIANT", "3")
    with pytest.raises(ValueError, match="one of"):
        AB.paged_settings(16, 64, 2, 128, "cpu")
