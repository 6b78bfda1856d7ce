"""The speculation policy (engine/batch/policy.py) with the global node budget, through the engine.

Exactness: under ``spec_policy="auto"`` every request's tokens equal the same request alone and
plain decoding (``ar``) at temperature 0, for random batches, arrivals, cancellations and tree
budgets 1-64, dense and hybrid tiny targets (fp32, CPU), with the oracle TEST DOUBLE drafter and a
real DFlashDrafter with random weights. Choices: a useless drafter (random weights) is dropped
for plain decoding after a few rounds; a good one keeps its trees.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
from ddtree_server.engine.batch.policy import MAX_BACKOFF, Profile, SpecPolicy
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams

from tests.server.batch_fixtures import (LAYERS, MAX_LEN, check_alone_batched_ar, oracle_drafter, random_specs,
                                         real_drafter, run_batched)
from tests.server.tiny import EOS, ByteTokenizer
from tests.server.drafter_fixtures import shipped_drafter

pytest_plugins = ["tests.server.tiny_fixtures"]   # the dense / hybrid module fixtures

GPU_LIKE = Profile.linear(1.0, 0.004, per_request=0.01, draft=0.15, block=8)   # rows nearly free


def _specs(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    specs = random_specs(seed, count)
    for s in specs:
        if s["mode"] == "ddtree":
            s["budget"] = rng.choice([None, 1, 2, 5, 16, 33, 64])
    return specs


def _engine(target, drafter, **kw) -> Engine:
    return Engine(target, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN,
                  spec_policy="auto", **kw)


# ---------------------------------------------------------------------------- pure bookkeeping
def test_profile_interpolates_and_scales_the_drafter():
    p = Profile([1, 16, 64], [1.0, 1.0, 3.0], per_request=0.1, draft=0.5, block=16)
    assert p.target(1, 8) == pytest.approx(1.1) and p.target(2, 40) == pytest.approx(2.2)
    assert p.target(1, 128) == pytest.approx(3.0 + 64 / 24 + 0.1)   # the last slope beyond the points
    assert p.drafter(0) == 0.0 and p.drafter(1) == pytest.approx(0.5)
    assert p.drafter(4) == pytest.approx(0.5 * 3.1 / 1.1)            # 4 blocks of 16 rows


def _table(p_top: float, depth: int = 4):
    """Top-2 rows: the first token with probability p_top, the second p_top / 10, at every depth."""
    return [[math.log(p_top), math.log(p_top / 10)]] * depth, [[1, 2]] * depth


def test_plan_spends_nodes_where_they_pay_and_backs_off_otherwise():
    pol = SpecPolicy(Profile.linear(1.0, 0.01, draft=0.1))
    good, bad = SimpleNamespace(spec=None), SimpleNamespace(spec=None)
    plan = pol.plan(2, 0, 2, [_table(0.9), _table(0.02)], [8, 8], [5, 6], [good, bad])
    assert plan.counts[0] >= 4 and plan.counts[1] == 0 and plan.speed > plan.plain_speed
    assert plan.trees[0].size == plan.counts[0] + 1 and plan.trees[1].size == 1
    assert pol.drafts(good) and not pol.drafts(bad)           # the request without nodes skips a round
    # a drafter that is never right: its weight falls, then it backs off for longer and longer
    req, drafted = SimpleNamespace(spec=None), []
    for _ in range(100):
        drafted.append(pol.drafts(req))
        if drafted[-1] and pol.plan(1, 0, 1, [_table(0.9)], [8], [0], [req]).nodes:
            pol.observe(req, 0)
    assert sum(drafted[-50:]) <= 3 and req.spec.backoff == MAX_BACKOFF, drafted


@pytest.mark.parametrize("seed", range(6))
def test_plan_stops_early_but_finds_the_best_node_total(seed):
    """The plan's early stop (bound at the profile's bends) gives the N of an exhaustive search."""
    from ddtree_server.speculative.budget import rank

    rng = random.Random(seed)
    b = rng.choice([1, 3, 8])
    tables = []
    for _ in range(b):
        tops = sorted((rng.random() ** 2 for _ in range(4)), reverse=True)
        tables.append(([[math.log(t / 4) for t in tops]] * 6, [[1, 2, 3, 4]] * 6))
    prof = Profile([1, 16, 64, 256], [1.0, 1.0 + rng.random() * 0.05, 1.3 + rng.random(), 4.0], draft=0.2)
    caps = [rng.choice([3, 16, 24]) for _ in range(b)]
    plan = SpecPolicy(prof).plan(b, 2, b, tables, caps, [0] * b, [SimpleNamespace(spec=None) for _ in range(b)])
    gains = rank(tables, caps).gains
    speeds = [(b + sum(gains[:n])) / (prof.target(b, b + 2 + n) + prof.drafter(b)) for n in range(len(gains) + 1)]
    assert plan.nodes == max(range(len(speeds)), key=lambda n: (speeds[n], -n))
    assert plan.speed == pytest.approx(speeds[plan.nodes])


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_policy_batched_equals_alone_and_ar_oracle(request, kind):
    target = request.getfixturevalue(kind)
    target.capture_layers = LAYERS
    specs = _specs(seed=23 if kind == "dense" else 8, count=12)
    drafter, ar = oracle_drafter(target, specs)
    engine = _engine(target, drafter, max_running=5, poison_freed_slots=True, profile=GPU_LIKE)
    check_alone_batched_ar(engine, specs, ar)
    assert engine.batch.last.kinds is not None or engine.batch.steps
    target.capture_layers = []


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_policy_batched_equals_alone_and_ar_random_drafter(request, kind):
    target = request.getfixturevalue(kind)
    engine = _engine(target, real_drafter(target), max_running=4, poison_freed_slots=True,
                     profile=Profile.linear(1.0, 0.0005, draft=0.01, block=6))   # trees almost free: some kept
    ar = Engine(target, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=1)
    check_alone_batched_ar(engine, _specs(seed=4, count=8), ar)
    target.capture_layers = []


def test_policy_with_padded_graph_layouts_and_prompt_chunks(dense, monkeypatch):
    """The policy's trees through the padded layouts of the batched-round and drafter CUDA graphs
    (run eagerly on the CPU), with whole prompts (oracle drafter: it knows prompts by their whole
    features) and with prompts prefilled in chunks (real drafter): alone == batched == ``ar``."""
    monkeypatch.setenv("DDTREE_BATCH_GRAPHS", "1")
    dense.capture_layers = LAYERS
    specs = _specs(seed=41, count=8)
    drafter, ar = oracle_drafter(dense, specs)
    engine = _engine(dense, drafter, max_running=4, poison_freed_slots=True, profile=GPU_LIKE, prefill_chunk=0)
    check_alone_batched_ar(engine, specs, ar)
    assert engine.batch.runner.graphs is not None
    engine = _engine(dense, real_drafter(dense), max_running=4, poison_freed_slots=True, prefill_chunk=8,
                     profile=Profile.linear(1.0, 0.0005, draft=0.01, block=6))
    check_alone_batched_ar(engine, _specs(seed=43, count=6), ar)
    dense.capture_layers = []


def test_measured_profile_on_the_cpu(dense):
    engine = _engine(dense, real_drafter(dense), max_running=3)
    prof = engine.batch.runner.policy.profile
    assert list(prof.rows) == sorted(prof.rows) and all(t > 0 for t in prof.seconds) and prof.draft > 0
    ids = list(b"the cat sat")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [t for ev in engine.generate(ids, params, mode="ar") for t in ev.token_ids]
    evs = list(engine.generate(ids, params))
    assert [t for ev in evs for t in ev.token_ids] == want
    st = evs[-1].stats
    assert st.spec_policy == "auto" and st.plain_rounds + st.chain_rounds + st.tree_rounds == st.decode_rounds
    dense.capture_layers = []


# ---------------------------------------------------------------------------- choices
def test_useless_drafter_falls_back_to_plain_decoding(dense):
    engine = _engine(dense, real_drafter(dense), max_running=4, profile=GPU_LIKE)
    specs = [dict(rid=f"u{i}", prompt=list(f"noise {i} here".encode()), mode="ddtree", budget=None, arrive=0,
                  cancel_after=None, params=dict(max_tokens=100, ignore_eos=True)) for i in range(3)]
    nodes = []
    batch = engine.batch
    reqs = [engine.make_request(s["prompt"], SamplingParams(**s["params"]), rid=s["rid"]) for s in specs]
    for req in reqs:
        batch.add(req)
    while batch.busy:
        batch.step()
        if batch.last.kind == "decode":
            nodes.append(batch.last.nodes)
    late = nodes[20:]   # then only a probe per request every MAX_BACKOFF rounds (or after a lucky accept)
    assert sum(n == 0 for n in late) >= 0.8 * len(late), nodes
    for req in reqs:
        st = req.events[-1].stats
        assert st.plain_rounds >= 0.75 * st.decode_rounds and st.spec_policy == "auto", st
    dense.capture_layers = []


def test_good_drafter_keeps_trees(dense):
    dense.capture_layers = LAYERS
    specs = _specs(seed=31, count=4)
    for s in specs:
        s.update(mode="ddtree", budget=16, arrive=0, cancel_after=None, params=dict(max_tokens=40, ignore_eos=True))
    drafter, _ = oracle_drafter(dense, specs)
    engine = _engine(dense, drafter, max_running=4, profile=GPU_LIKE)
    got, _ = run_batched(engine, specs)
    for s in specs:
        evs = list(engine.generate(s["prompt"], SamplingParams(**s["params"])))
        st = evs[-1].stats
        assert st.tree_rounds + st.chain_rounds >= 0.8 * st.decode_rounds, st
        assert st.mean_acceptance_length > 2.0 and st.mean_tree_nodes > 1.0, st
        assert [t for ev in evs for t in ev.token_ids] == got[s["rid"]]
    dense.capture_layers = []


def test_bench_runs_the_policy_as_a_method(dense):
    from ddtree_server.bench.concurrency import closed_loop

    dense.capture_layers = LAYERS
    specs = _specs(seed=2, count=3)
    drafter, _ = oracle_drafter(dense, specs)
    engine = _engine(dense, drafter, max_running=3, profile=GPU_LIKE)
    prompts = [s["prompt"] for s in specs]
    row = closed_loop(engine, prompts, mode="policy", budget=8, concurrency=3, max_new_tokens=8)
    fixed = closed_loop(engine, prompts, mode="ddtree", budget=8, concurrency=3, max_new_tokens=8)
    assert row["requests"] == fixed["requests"] == 3 and row["tokens"] == fixed["tokens"]
    dense.capture_layers = []


@pytest.mark.slow
def test_smollm2_with_the_shipped_drafter_keeps_trees_and_equals_ar(smollm2):
    """The real SmolLM2 and the shipped drafter (CPU fp32): the policy keeps its trees (under a
    profile where rows are nearly free, as on a GPU) and every request's text equals ``ar``."""

    model = smollm2.model
    drafter = shipped_drafter(smollm2)
    engine = Engine(model, smollm2.tokenizer, drafter, max_model_len=512, eos_token_ids=smollm2.eos_token_ids,
                    max_running=2, spec_policy="auto", profile=Profile.linear(1.0, 0.002, draft=0.1))
    questions = ["Write a Python function that returns the n-th Fibonacci number iteratively.",
                 "How many clips did Natalia sell if she sold 48 in April and half as many in May?"]
    params = dict(max_tokens=32, ignore_eos=True)
    specs = [dict(rid=f"q{i}", prompt=engine.encode(q), mode="ddtree", budget=b, arrive=i, cancel_after=None,
                  params=params) for i, (q, b) in enumerate(zip(questions, [64, 6]))]
    got, _ = run_batched(engine, specs)
    for s in specs:
        ar = [t for ev in engine.generate(s["prompt"], SamplingParams(**params), mode="ar") for t in ev.token_ids]
        evs = list(engine.generate(s["prompt"], SamplingParams(**params), tree_budget=s["budget"]))
        assert got[s["rid"]] == ar == [t for ev in evs for t in ev.token_ids]
        st = evs[-1].stats
        assert st.tree_rounds + st.chain_rounds >= 0.8 * st.decode_rounds and st.mean_acceptance_length > 1.5, st
    model.capture_layers = []
