"""Continuous batching: every request's tokens are the same alone and in any batch (fp32, CPU).

32 requests arrive at random steps with random prompts, ``max_tokens``, stop strings, modes
(plain / DFlash / DDTree), seeds and cancellations, into a batch engine with fewer slots than
requests (queueing and slot reuse; freed slots are filled with NaN, so stale state would show).
Each request's tokens must equal the same request run alone, and at temperature 0 those of plain
decoding (``ar``). Dense (tiny Qwen3) and hybrid (tiny Qwen3.5) targets. The drafter is a TEST
DOUBLE that knows every prompt's greedy continuation and is wrong at every 4th position (so
DDTree recovers through siblings and compacts the cache over many rounds); the real
``DFlashDrafter`` (random weights) runs the batched drafter forward.
"""

from __future__ import annotations

import pytest
import torch
from ddtree_server.engine.engine import Engine

from tests.server.batch_fixtures import (HIDDEN, LAYERS, MAX_LEN, check_alone_batched_ar, oracle_drafter, prompt_features,
                                         random_specs, real_drafter, run_alone, run_batched)
from tests.server.tiny import EOS, ByteTokenizer

pytest_plugins = ["tests.server.tiny_fixtures"]   # the dense / hybrid module fixtures


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_32_random_requests_equal_alone_and_ar(request, kind):
    target = request.getfixturevalue(kind)
    target.capture_layers = LAYERS
    specs = random_specs(seed=17 if kind == "dense" else 5)
    drafter, ar = oracle_drafter(target, specs)
    engine = Engine(target, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN,
                    max_running=8, poison_freed_slots=True)
    check_alone_batched_ar(engine, specs, ar)
    target.capture_layers = []


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_padded_graph_layout_equals_alone_and_ar(request, kind, monkeypatch):
    """The padded layout of the batched-round CUDA graphs (engine/batch/graphs.py: the rows padded
    to a total bucket and the batch to a batch bucket by padding blocks on a scratch slot), run
    eagerly on the CPU: every request's tokens are still its own alone and ``ar``'s, over many
    rounds and slot reuses. Hybrids: rounds of plain rows (the GDN step with a request axis, the
    padding rows on the scratch slot's state) take it, the others run eagerly."""
    monkeypatch.setenv("DDTREE_BATCH_GRAPHS", "1")
    target = request.getfixturevalue(kind)
    target.capture_layers = LAYERS
    specs = random_specs(seed=29, count=12)
    if kind == "hybrid":   # mostly plain decoding: rounds of plain rows only
        specs = [dict(s, mode="ar" if i % 4 else s["mode"]) for i, s in enumerate(specs)]
    drafter, ar = oracle_drafter(target, specs)
    engine = Engine(target, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN,
                    max_running=6, poison_freed_slots=True)
    graphs = engine.batch.runner.graphs
    assert graphs is not None and graphs.scratch == 6
    check_alone_batched_ar(engine, specs, ar)
    assert graphs.rounds > (15 if kind == "dense" else 5)
    target.capture_layers = []


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_real_drafter_batched_equals_alone_and_ar(request, kind):
    target = request.getfixturevalue(kind)
    engine = Engine(target, ByteTokenizer(), real_drafter(target), eos_token_ids=[EOS], max_model_len=MAX_LEN,
                    max_running=6, poison_freed_slots=True)
    ar = Engine(target, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=1)
    check_alone_batched_ar(engine, random_specs(seed=3, count=12), ar)
    target.capture_layers = []


def test_padded_shapes_fill_every_bucket():
    """(B, N_pad, r): padding rows fill the padding blocks with 1 .. r rows each, all buckets."""
    import random as _random

    from ddtree_server.engine.batch.graphs import BATCH_BUCKETS, ROW_BUCKETS, TOTAL_BUCKETS, padded_shape

    rng = _random.Random(4)
    for _ in range(3000):
        sizes = [rng.choice([1, 1, 1, 16, 17, rng.randint(1, 80)]) for _ in range(rng.randint(1, 64))]
        got = padded_shape(sizes)
        if got is None:
            assert sum(sizes) > TOTAL_BUCKETS[-1] // 2   # only near the largest graph
            continue
        b_pad, n_pad, r = got
        k, extra = b_pad - len(sizes), n_pad - sum(sizes)
        assert b_pad in BATCH_BUCKETS and n_pad in TOTAL_BUCKETS and r in ROW_BUCKETS and r >= max(sizes)
        assert (k == 0 and extra == 0) or (k >= 1 and k <= extra <= k * r)


def test_padded_layouts_with_the_real_drafter_equal_alone_and_ar(dense, monkeypatch):
    """Both padded layouts (target rounds and drafter rounds, DDTREE_BATCH_GRAPHS=1, eager on the
    CPU) over many rounds with slot reuse: each request's tokens are its own alone and ``ar``'s."""
    monkeypatch.setenv("DDTREE_BATCH_GRAPHS", "1")
    engine = Engine(dense, ByteTokenizer(), real_drafter(dense), eos_token_ids=[EOS], max_model_len=MAX_LEN,
                    max_running=4, poison_freed_slots=True)
    ar = Engine(dense, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=1)
    check_alone_batched_ar(engine, random_specs(seed=11, count=8), ar)
    assert engine.batch.runner.draft_graphs.rounds > 5
    dense.capture_layers = []


@pytest.mark.parametrize("passes", ["one", "per-request"])
def test_batched_drafter_forward_equals_per_request(dense, passes, monkeypatch):
    """The batched draft forward gives each request the logits of its own per-request proposal,
    with the requests' attention in one pass or in one pass each (``draft.PASS_BYTES``)."""
    from ddtree_server.engine.batch import draft as draft_mod
    from ddtree_server.engine.batch.draft import propose_batch
    from ddtree_server.engine.batch.pools import SlotPool

    if passes == "per-request":
        monkeypatch.setattr(draft_mod, "PASS_BYTES", 1)

    drafter = real_drafter(dense, block=8)
    dense.capture_layers = LAYERS
    prompts = [list(b"hello there"), list(b"a b c d e f g h i j"), list(b"xyz")]
    ctxs = [prompt_features(dense, p) for p in prompts]
    pool = SlotPool(lambda: drafter.new_cache(64), 4)
    for i in range(4):
        pool.poison(i)
        pool[i].crop(0)
    slots = [2, 0, 3]
    got = propose_batch(drafter, pool.pool("k"), pool.pool("v"), [pool[s] for s in slots], slots, ctxs,
                        [5, 6, 7], [len(p) for p in prompts])
    for i, (ctx, p) in enumerate(zip(ctxs, prompts)):
        want = drafter.propose(drafter.new_cache(64), ctx, [5, 6, 7][i], len(p))
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    dense.capture_layers = []


def test_drafter_attention_passes_keep_their_copies_within_the_limit():
    from types import SimpleNamespace

    from ddtree_server.engine.batch.draft import request_passes

    attn = SimpleNamespace(n_heads=32, n_kv=8, head_dim=128)        # the Qwen3.6-27B drafter's heads
    per = 2 * 4112 * 8 * 128 * 2 * (1 + 4)                           # k + v, gathered + repeated 4x, bf16
    spans = request_passes(150, 4112, attn, 2, limit=512 << 20)
    assert spans[0] == (0, (512 << 20) // per) and spans[-1][1] == 150
    assert all(a == e0 for (_, e0), (a, _) in zip(spans, spans[1:]))  # contiguous, every request once
    assert request_passes(3, 10 ** 9, attn, 2, limit=1) == [(0, 1), (1, 2), (2, 3)]   # at least one each
    assert request_passes(5, 16, SimpleNamespace(n_heads=4, n_kv=4, head_dim=8), 4) == [(0, 5)]


def test_padded_drafter_layout_equals_propose_batch(dense):
    """The padded layout of the batched drafter graphs (engine/batch/draft_graphs.py: context rows
    padded to the block size, the batch to a bucket on a scratch slot, a fixed key window), run
    eagerly: the same draft logits as ``propose_batch`` over two rounds, and the same K/V rows."""
    from ddtree_server.engine.batch.draft import propose_batch
    from ddtree_server.engine.batch.draft_graphs import DraftGraphs
    from ddtree_server.engine.batch.pools import SlotPool

    drafter = real_drafter(dense, block=8)
    torch.manual_seed(0)
    pools = [SlotPool(lambda: drafter.new_cache(300), 5) for _ in range(2)]
    padded = DraftGraphs(drafter, pools[1].pool("k"), pools[1].pool("v"), capture=False)
    slots, lens = [3, 0, 1], [5, 40, 9]
    ctx0 = [torch.randn(n, 2 * HIDDEN) for n in lens]
    for pool in pools:   # the prompts' first proposals (eager in both)
        for i in range(5):
            pool.poison(i)
            pool[i].crop(0)
        propose_batch(drafter, pool.pool("k"), pool.pool("v"), [pool[s] for s in slots], slots, ctx0, [1, 2, 3], lens)
    for rnd, accepted in enumerate(([1, 8, 3], [2, 1, 7])):
        ctxs = [torch.randn(n, 2 * HIDDEN) for n in accepted]
        starts = [pools[0][s].length + n for s, n in zip(slots, accepted)]
        want = propose_batch(drafter, pools[0].pool("k"), pools[0].pool("v"), [pools[0][s] for s in slots], slots,
                             ctxs, [4, 5, 6], starts)
        got = padded.propose([pools[1][s] for s in slots], slots, ctxs, [4, 5, 6], starts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert [pools[1][s].length for s in slots] == starts and padded.rounds == rnd + 1
        for s, n in zip(slots, starts):
            torch.testing.assert_close(pools[1].pool("k")[s, :, :, :n], pools[0].pool("k")[s, :, :, :n])


def test_seeded_sampling_same_alone_batched_and_in_every_mode(dense):
    """A seeded request at T > 0 gives the same tokens alone, in a batch and in every mode."""
    drafter = real_drafter(dense)
    engine = Engine(dense, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=8)
    params = dict(max_tokens=40, ignore_eos=True, temperature=1.0, top_p=0.9, seed=1234)
    spec = dict(prompt=list(b"once upon a time"), budget=None, params=params)
    alone = run_alone(engine, dict(spec, mode="ar"))[0]
    for mode in ("dflash", "ddtree"):
        assert run_alone(engine, dict(spec, mode=mode))[0] == alone, mode
    others = [dict(rid=f"o{i}", prompt=list(f"noise {i}".encode()), mode=m, budget=None, arrive=i,
                   cancel_after=None, params=dict(max_tokens=30, temperature=0.7, seed=i))
              for i, m in enumerate(["ar", "dflash", "ddtree"] * 2)]
    for mode in ("ar", "dflash", "ddtree"):
        got, _ = run_batched(engine, others + [dict(spec, rid="me", mode=mode, arrive=2, cancel_after=None)])
        assert got["me"] == alone, mode
    assert len(set(map(tuple, [alone, run_alone(engine, dict(spec, mode="ar", params=dict(params, seed=1)))[0]]))) == 2
