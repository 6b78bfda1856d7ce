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

import random
import threading

import pytest
import torch
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams

from tests.server.hybrid_fixtures import tiny_hybrid
from tests.server.tiny import EOS, VOCAB, ByteTokenizer, OracleDrafter, tiny_target

LAYERS, HIDDEN, MAX_LEN = [1, 2], 64, 192


class ManyOracle(OracleDrafter):
    """TEST DOUBLE: an OracleDrafter for several prompts; a slot's request is recognised by the
    prompt features of its first proposal (bitwise those of the reference prefill)."""

    def __init__(self, table, **kw):
        super().__init__(0, [], **kw)
        self.table = table  # [(prompt features, prompt_len, reference)]

    def propose(self, cache, ctx, bonus_token, start_pos):
        if cache.length == 0:
            cache.who = next((n, ref) for f, n, ref in self.table
                             if f.shape == ctx.shape and torch.equal(f, ctx))
        self.prompt_len, self.reference = cache.who
        return super().propose(cache, ctx, bonus_token, start_pos)


def _features(target, ids):
    cache = target.new_cache(MAX_LEN + 1)
    _, feats = target.forward(cache, torch.tensor(ids), torch.arange(len(ids)), last_only=True)
    return feats.clone()


def _specs(seed: int, count: int = 32):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "the", "cat", "sat", "on", "a", "mat", "1+2=", "zz"]
    out = []
    for i in range(count):
        prompt = list(" ".join(rng.choice(words) for _ in range(rng.randint(1, 9))).encode())
        mode = rng.choice(["ar", "dflash", "ddtree", "ddtree"])
        sampled = rng.random() < 0.25
        out.append(dict(
            rid=f"r{i}", prompt=prompt, mode=mode, budget=rng.choice([None, 3, 8, 20]) if mode == "ddtree" else None,
            params=dict(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.7,
                        stop=[rng.choice(["a", "e", "zz"])] if rng.random() < 0.3 else [],
                        temperature=0.9 if sampled else 0.0, seed=rng.randint(0, 99) if sampled else None),
            arrive=rng.randint(0, 40), cancel_after=rng.randint(1, 6) if rng.random() < 0.15 else None))
    return out


def _alone(engine, spec, mode=None):
    toks, reason = [], None
    for ev in engine.generate(spec["prompt"], SamplingParams(**spec["params"]), mode=mode or spec["mode"],
                              tree_budget=spec["budget"]):
        toks += ev.token_ids
        reason = ev.finish_reason or reason
    return toks, reason


def _batched(engine, specs):
    """Drive the batch engine by hand: arrivals at their step, cancellations after some events."""
    batch, reqs, got, events = engine.batch, {}, {s["rid"]: [] for s in specs}, {}
    step = 0
    while len(reqs) < len(specs) or batch.busy:
        for s in specs:
            if s["arrive"] == step or (s["rid"] not in reqs and not batch.busy and s["arrive"] < step):
                req = engine.make_request(s["prompt"], SamplingParams(**s["params"]), mode=s["mode"],
                                          tree_budget=s["budget"], cancel=threading.Event(), rid=s["rid"])
                batch.add(req)
                reqs[s["rid"]] = (s, req)
        for req, ev in batch.step():
            got[req.rid] += ev.token_ids
            events[req.rid] = events.get(req.rid, 0) + 1
            s = reqs[req.rid][0]
            if s["cancel_after"] is not None and events[req.rid] >= s["cancel_after"]:
                req.cancel.set()
            if ev.finish_reason:
                events[req.rid] = ev.finish_reason
        step += 1
    return got, events


def _check(engine, specs, ar_engine):
    got, finish = _batched(engine, specs)
    assert max(engine.batch.runner.caches.tensors["0:k"].shape[0], 1) < len(specs)
    for s in specs:
        alone, reason = _alone(engine, s)
        if finish[s["rid"]] == "cancelled":
            assert got[s["rid"]] == alone[: len(got[s["rid"]])], s
            continue
        assert got[s["rid"]] == alone, s
        assert finish[s["rid"]] == reason, s
        if s["params"]["temperature"] == 0.0 or s["params"]["seed"] is not None:
            assert _alone(ar_engine, s, mode="ar")[0] == alone, s


def _oracle(target, specs):
    ar = Engine(target, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=1)
    table = []
    for s in specs:
        ref, _ = _alone(ar, dict(s, params=dict(max_tokens=MAX_LEN - len(s["prompt"]) - 1, ignore_eos=True)),
                        mode="ar")
        table.append((_features(target, s["prompt"]), len(s["prompt"]), ref))
    return ManyOracle(table, vocab=VOCAB, hidden=HIDDEN, layer_ids=LAYERS, block_size=8), ar


@pytest.fixture(scope="module")
def dense():
    torch.set_num_threads(1)
    return tiny_target()


@pytest.fixture(scope="module")
def hybrid():
    torch.set_num_threads(1)
    return tiny_hybrid("3gdn+attn", seed=21)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_32_random_requests_equal_alone_and_ar(request, kind):
    target = request.getfixturevalue(kind)
    target.capture_layers = LAYERS
    specs = _specs(seed=17 if kind == "dense" else 5)
    drafter, ar = _oracle(target, specs)
    engine = Engine(target, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN,
                    max_running=8, poison_freed_slots=True)
    _check(engine, specs, ar)
    target.capture_layers = []


def test_padded_graph_layout_equals_alone_and_ar(dense, monkeypatch):
    """The padded layout of the batched-round CUDA graphs (engine/batch/graphs.py: blocks padded to
    a row bucket, the batch to a batch bucket on a scratch slot), run eagerly on the CPU: every
    request's tokens are still its own alone and ``ar``'s, over many rounds and slot reuses."""
    from ddtree_server.engine.batch import graphs as batch_graphs

    monkeypatch.setenv("DDTREE_BATCH_GRAPHS", "1")
    monkeypatch.setattr(batch_graphs, "WASTE", 1e9)   # pad plain rows to trees too: every round padded
    dense.capture_layers = LAYERS
    specs = _specs(seed=29, count=12)
    drafter, ar = _oracle(dense, specs)
    engine = Engine(dense, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN,
                    max_running=6, poison_freed_slots=True)
    graphs = engine.batch.runner.graphs
    assert graphs is not None and graphs.scratch == 6
    _check(engine, specs, ar)
    assert graphs.rounds > 15
    dense.capture_layers = []


def _real_drafter(target, block=6):
    from ddtree_server.models.drafter.config import DrafterConfig
    from ddtree_server.models.drafter.model import DFlashDrafter

    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block,
           "dflash_config": {"mask_token_id": 257, "target_layer_ids": LAYERS}, "num_hidden_layers": 2,
           "hidden_size": HIDDEN, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 10000.0}
    torch.manual_seed(1)
    return DFlashDrafter(DrafterConfig.from_dict(raw), target.embed_tokens, target.lm_head).eval()


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_real_drafter_batched_equals_alone_and_ar(request, kind):
    target = request.getfixturevalue(kind)
    engine = Engine(target, ByteTokenizer(), _real_drafter(target), eos_token_ids=[EOS], max_model_len=MAX_LEN,
                    max_running=6, poison_freed_slots=True)
    ar = Engine(target, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=1)
    _check(engine, _specs(seed=3, count=12), ar)
    target.capture_layers = []


def test_padded_layouts_with_the_real_drafter_equal_alone_and_ar(dense, monkeypatch):
    """Both padded layouts (target rounds and drafter rounds, DDTREE_BATCH_GRAPHS=1, eager on the
    CPU) over many rounds with slot reuse: each request's tokens are its own alone and ``ar``'s."""
    monkeypatch.setenv("DDTREE_BATCH_GRAPHS", "1")
    engine = Engine(dense, ByteTokenizer(), _real_drafter(dense), eos_token_ids=[EOS], max_model_len=MAX_LEN,
                    max_running=4, poison_freed_slots=True)
    ar = Engine(dense, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=1)
    _check(engine, _specs(seed=11, count=8), ar)
    assert engine.batch.runner.draft_graphs.rounds > 5
    dense.capture_layers = []


def test_batched_drafter_forward_equals_per_request(dense):
    """The batched draft forward gives each request the logits of its own per-request proposal."""
    from ddtree_server.engine.batch.draft import propose_batch
    from ddtree_server.engine.batch.pools import SlotPool

    drafter = _real_drafter(dense, block=8)
    dense.capture_layers = LAYERS
    prompts = [list(b"hello there"), list(b"a b c d e f g h i j"), list(b"xyz")]
    ctxs = [_features(dense, p) for p in prompts]
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


def test_padded_drafter_layout_equals_propose_batch(dense):
    """The padded layout of the batched drafter graphs (engine/batch/draft_graphs.py: context rows
    padded to the block size, the batch to a bucket on a scratch slot, a fixed key window), run
    eagerly: the same draft logits as ``propose_batch`` over two rounds, and the same K/V rows."""
    from ddtree_server.engine.batch.draft import propose_batch
    from ddtree_server.engine.batch.draft_graphs import DraftGraphs
    from ddtree_server.engine.batch.pools import SlotPool

    drafter = _real_drafter(dense, block=8)
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
    drafter = _real_drafter(dense)
    engine = Engine(dense, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=8)
    params = dict(max_tokens=40, ignore_eos=True, temperature=1.0, top_p=0.9, seed=1234)
    spec = dict(prompt=list(b"once upon a time"), budget=None, params=params)
    alone = _alone(engine, dict(spec, mode="ar"))[0]
    for mode in ("dflash", "ddtree"):
        assert _alone(engine, dict(spec, mode=mode))[0] == alone, mode
    others = [dict(rid=f"o{i}", prompt=list(f"noise {i}".encode()), mode=m, budget=None, arrive=i,
                   cancel_after=None, params=dict(max_tokens=30, temperature=0.7, seed=i))
              for i, m in enumerate(["ar", "dflash", "ddtree"] * 2)]
    for mode in ("ar", "dflash", "ddtree"):
        got, _ = _batched(engine, others + [dict(spec, rid="me", mode=mode, arrive=2, cancel_after=None)])
        assert got["me"] == alone, mode
    assert len(set(map(tuple, [alone, _alone(engine, dict(spec, mode="ar", params=dict(params, seed=1)))[0]]))) == 2
