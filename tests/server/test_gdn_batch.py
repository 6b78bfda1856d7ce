"""The GDN mixer with a request axis (models/hybrid/gdn_batch.py) equals each request's own mixer.

Slots of a pooled hybrid cache hold random recurrent / conv states; a round of plain rows (one
row committed at once), chains and trees on scattered slots (and one of pending blocks only) runs once through ``hybrid_forward``
with the pooled GDN tensors (batched) and once per request (its cache's mixer): logits, the slots'
committed states after the commit of a random accepted path, and the untouched slots agree
(fp32, CPU). Both GDN tree methods (``node`` stays per request inside the batched forward).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ddtree_server.engine.batch.forward import Block, Layout
from ddtree_server.engine.batch.forward_hybrid import hybrid_forward
from ddtree_server.engine.batch.pools import SlotPool
from ddtree_server.models.hybrid.gdn_batch import gdn_tensors
from ddtree_server.models.hybrid.gdn_groups import windows
from ddtree_server.models.hybrid.tree import tree_meta
from tests.server.hybrid_fixtures import random_tree, tiny_hybrid

SLOTS, MAX_LEN = 7, 64


def _pool(model, seed: int, batched: bool) -> SlotPool:
    """The batched side's slots share one round scratch (chunk method), as the engine's do; the
    per-request side's have their own."""
    scratch = model.new_scratch(128) if batched and model.method == "chunk" else None   # cap 80 as own
    pool = SlotPool(lambda: model.new_cache(MAX_LEN, scratch=scratch), SLOTS)
    pool.scratch = scratch
    g = torch.Generator().manual_seed(seed)
    for name in ("state", "conv"):
        t = pool.pool(name)
        t.copy_(0.5 * torch.randn(t.shape, generator=g))
    return pool


def _round(model, pool: SlotPool, blocks: list[Block], batched: bool):
    gdn = gdn_tensors(pool, model.method, pool.scratch) if batched else None
    caches = [pool[b.slot] for b in blocks]
    for c, b in zip(caches, blocks):
        c.length = b.s
    lay = Layout(blocks, torch.device("cpu"))
    logits, _ = hybrid_forward(model, caches, pool.pool("k"), pool.pool("v"), lay, gdn)
    return logits


@pytest.mark.parametrize("method", ["chunk", "node"])
def test_batched_gdn_rows_and_commits_equal_per_request(method):
    torch.set_num_threads(1)
    model = tiny_hybrid("qwen3.6x2", seed=4, method=method)
    rng = random.Random(11)
    for trial in range(3):
        slots = rng.sample(range(SLOTS), 5)
        blocks = []
        for j, slot in enumerate(slots):
            n = [1, 1, rng.randint(2, 7), rng.randint(2, 9), rng.randint(2, 9)][j] if trial < 2 or j > 1 else \
                rng.randint(2, 5)   # the last trial: every block pending
            mask = random_tree(rng, n) if j == 4 or (j == 3 and trial % 2) else None
            blocks.append(Block(slot, rng.randint(3, 20), [rng.randrange(250) for _ in range(n)],
                                list(range(n)) if mask is None else (mask.sum(1) - 1).tolist(), mask))
        pools = [_pool(model, seed=trial, batched=True), _pool(model, seed=trial, batched=False)]
        with torch.no_grad():
            out = [_round(model, p, blocks, batched) for p, batched in zip(pools, (True, False))]
            torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-4)   # fp32, any CPU BLAS
            for p in pools:   # commit a random root path of each pending block (as the walk would)
                for b in blocks:
                    if len(b.ids) > 1:
                        anc = b.mask if b.mask is not None else np.tri(len(b.ids), dtype=bool)
                        leaf = random.Random(b.slot).randrange(len(b.ids))
                        p[b.slot].keep(b.s, np.flatnonzero(anc[leaf]).tolist())
        for name in ("state", "conv"):
            a, b = pools[0].pool(name), pools[1].pool(name)
            k1 = model.config.linear_conv_kernel_dim - 1
            if name == "conv":
                a, b = a[:, :, :k1], b[:, :, :k1]
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)



def test_host_conv_windows_equal_tree_meta():
    rng = random.Random(5)
    for n in (1, 2, 5, 17):
        for mask in (None, random_tree(rng, n)):
            want = tree_meta(None if mask is None else torch.from_numpy(mask), n, 4, torch.device("cpu")).win
            assert np.array_equal(windows(mask, n, 4), want.numpy()), (n, mask)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batched_hybrid_plain_rounds_take_graphs_and_equal_alone():
    """On CUDA (fp32): plain decoding of several requests takes the captured hybrid graphs
    (GDN step kernels with a request axis) and gives each request its tokens alone."""
    from ddtree_server.engine.engine import Engine

    from tests.server.batch_fixtures import random_specs, run_alone, run_batched
    from tests.server.hybrid_fixtures import tiny_hybrid_ours
    from tests.server.tiny import EOS, ByteTokenizer

    model = tiny_hybrid_ours("qwen3.6x2", seed=4, device="cuda")
    specs = [dict(s, mode="ar", arrive=0, cancel_after=None) for s in random_specs(seed=8, count=6)]
    engine = Engine(model, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=64, max_running=6)
    got, _ = run_batched(engine, specs)
    graphs = engine.batch.runner.graphs
    assert graphs is not None and graphs.capture and graphs.rounds > 0
    for s in specs:
        assert got[s["rid"]] == run_alone(engine, s)[0], s
