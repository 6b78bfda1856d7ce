"""Hybrid speculative rounds in the padded layout of the batched-round CUDA graphs (engine/batch/graphs.py,
hybrid_rounds.py), run eagerly on the CPU (``DDTREE_BATCH_GRAPHS=1``): DFlash chains and DDTree
trees (budgets 4 and 16) of many requests with arrivals, cancellations and slot reuse (freed slots
NaN-poisoned) give every request its tokens alone and ``ar``'s, the rounds with drafts taking the
padded pending layout (``chunk`` method; the ``node`` method runs them eagerly) and one commit for
all slots (``hybrid_rounds.commit_pending``). The GDN states that commit leaves equal those of the
eager forward and per-slot ``keep``. On CUDA: the captured chain and tree rounds give the tokens of
the eager rounds and of each request alone.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from ddtree_server.engine.batch.forward import Block, Layout
from ddtree_server.engine.batch.forward_hybrid import hybrid_forward
from ddtree_server.engine.batch.graphs import BatchGraphs, padded_shape
from ddtree_server.engine.batch.hybrid_rounds import commit_pending
from ddtree_server.engine.batch.pools import SlotPool
from ddtree_server.engine.engine import Engine
from ddtree_server.models.hybrid.gdn_batch import gdn_tensors

from tests.server.batch_fixtures import (MAX_LEN, check_alone_batched_ar, oracle_drafter, random_specs, real_drafter,
                                         run_alone, run_batched)
from tests.server.hybrid_fixtures import random_tree, tiny_hybrid, tiny_hybrid_ours
from tests.server.tiny import EOS, ByteTokenizer


def _spec_specs(seed: int, count: int) -> list[dict]:
    """Mostly speculative requests: DFlash and DDTree with tree budgets 4 and 16, a few ``ar``."""
    modes = [("dflash", None), ("ddtree", 4), ("ddtree", 16), ("dflash", None), ("ddtree", 16), ("ar", None)]
    return [dict(s, mode=modes[i % 6][0], budget=modes[i % 6][1], params=dict(s["params"], max_tokens=12 + i % 20))
            for i, s in enumerate(random_specs(seed=seed, count=count))]


@pytest.mark.parametrize("method", ["chunk", "node"])
def test_padded_hybrid_spec_rounds_equal_alone_and_ar(method, monkeypatch):
    monkeypatch.setenv("DDTREE_BATCH_GRAPHS", "1")
    torch.set_num_threads(1)
    target = tiny_hybrid("3gdn+attn", seed=21, method=method)
    target.capture_layers = [1, 2]
    specs = _spec_specs(seed=31, count=10)
    drafter, ar = oracle_drafter(target, specs)
    engine = Engine(target, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN,
                    max_running=5, poison_freed_slots=True)
    graphs = engine.batch.runner.graphs
    check_alone_batched_ar(engine, specs, ar)
    if method == "chunk":
        assert graphs.pending_rounds >= 20, graphs.pending_rounds
    else:
        assert graphs.pending_rounds == 0 and graphs.rounds > 0


def _path(block: Block) -> list[int]:
    anc = block.mask if block.mask is not None else np.tri(len(block.ids), dtype=bool)
    return np.flatnonzero(anc[random.Random(block.slot).randrange(len(block.ids))]).tolist()


def test_padded_commit_states_equal_eager_keep():
    """One round of chains, trees and one-row blocks on scattered slots of two identical pools:
    the padded pending forward + ``commit_pending`` against ``hybrid_forward`` + per-slot ``keep``:
    logits of the requests' rows, the slots' states, committed conv rows and K/V agree (fp32)."""
    torch.set_num_threads(1)
    model = tiny_hybrid("qwen3.6x2", seed=4)
    rng = random.Random(3)
    slots = 9
    for trial in range(3):
        scratches = [model.new_scratch(128) for _ in range(2)]   # each pool's round scratch
        pools = [SlotPool(lambda scr=scr: model.new_cache(64, scratch=scr), slots) for scr in scratches]
        g = torch.Generator().manual_seed(trial)
        for name in ("state", "conv", "k", "v"):
            init = 0.5 * torch.randn(pools[0].pool(name).shape, generator=g)
            for p in pools:
                p.pool(name).copy_(init)
        blocks = []
        for j, slot in enumerate(rng.sample(range(slots - 1), 6)):
            n = [1, rng.randint(2, 9), rng.randint(2, 16), rng.randint(2, 17), 16, 5][j]
            mask = random_tree(rng, n) if j in (3, 5) or (j == 2 and trial) else None
            blocks.append(Block(slot, rng.randint(3, 20), [rng.randrange(250) for _ in range(n)],
                                list(range(n)) if mask is None else (mask.sum(1) - 1).tolist(), mask))
        paths = [_path(b) for b in blocks]
        out = []
        for pool, scr, padded in zip(pools, scratches, (True, False)):
            gdn = gdn_tensors(pool, "chunk", scr)
            caches = [pool[b.slot] for b in blocks]
            for c, b in zip(caches, blocks):
                c.length, c.pending = b.s, None
            k, v = pool.pool("k"), pool.pool("v")
            with torch.no_grad():
                if padded:
                    graphs = BatchGraphs(model, k, v, capture=False, gdn=gdn)
                    shape = graphs.shape(blocks)
                    assert shape is not None and shape[3] and shape[:3] == padded_shape([len(b.ids) for b in blocks])
                    logits, _, starts = graphs.forward(blocks, shape, caches)
                    commit_pending(k, v, gdn, caches, None, [b.slot for b in blocks], [b.s for b in blocks],
                                   starts, paths)
                else:
                    lay = Layout(blocks, torch.device("cpu"))
                    logits, _ = hybrid_forward(model, caches, k, v, lay, gdn)
                    starts = lay.offsets[:-1]
                    for c, b, p in zip(caches, blocks, paths):
                        c.keep(b.s, p)
            out.append(torch.cat([logits[a:a + len(b.ids)] for a, b in zip(starts, blocks)]))
            assert [c.length for c in caches] == [b.s + len(p) for b, p in zip(blocks, paths)]
        torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-4)
        used = [b.slot for b in blocks]
        k1 = model.config.linear_conv_kernel_dim - 1
        for name in ("state", "conv", "k", "v"):
            a, b = pools[0].pool(name)[used], pools[1].pool(name)[used]
            if name == "conv":
                a, b = a[:, :, :k1], b[:, :, :k1]
            if name in ("k", "v"):   # the committed rows of each slot
                a = torch.stack([a[i, :, :, : blk.s + len(p)].sum() for i, (blk, p) in enumerate(zip(blocks, paths))])
                b = torch.stack([b[i, :, :, : blk.s + len(p)].sum() for i, (blk, p) in enumerate(zip(blocks, paths))])
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_captured_hybrid_chain_and_tree_rounds_equal_eager(monkeypatch):
    """On CUDA (fp32): DFlash chains and DDTree trees of several requests replay captured pending
    rounds, whose tokens equal the eager rounds' (``DDTREE_BATCH_GRAPHS=0``) and each request's alone."""
    model = tiny_hybrid_ours("qwen3.6x2", seed=4, device="cuda")
    specs = [dict(s, arrive=0, cancel_after=None) for s in _spec_specs(seed=8, count=6)]
    drafter = real_drafter(model).to("cuda")   # random weights: chains and trees every round
    got = []
    for flag in ("1", "0"):
        monkeypatch.setenv("DDTREE_BATCH_GRAPHS", flag)
        engine = Engine(model, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=6)
        got.append(run_batched(engine, specs)[0])
        graphs = engine.batch.runner.graphs
        if flag == "1":
            assert graphs is not None and graphs.capture and graphs.pending_rounds >= 3, graphs
    assert got[0] == got[1]
    for s in specs:
        assert got[0][s["rid"]] == run_alone(engine, s)[0], s
