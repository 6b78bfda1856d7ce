"""engine/batch/solo_round.py: the batch-1 DDTree round on the device equals the host round.

Two engines over the same weights step in lockstep, one with the device round (top-K, device tree,
verify inputs into the graphed target's static buffers, walk, fixed-shape commit; eager on the
CPU), one with today's host round (heap tree, host walk, ``KVCache.keep``). After every step the
emitted tokens, the cache length, slot 0's live K/V rows and the drafter's next context rows are
bitwise equal (fp32, CPU; draft logits without exact ties), and the tokens equal ``ar``'s.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams
from ddtree_server.models.dense.graphs import GraphedTarget
from tests.server.tiny import VOCAB, ByteTokenizer, OracleDrafter
from tests.server.drafter_fixtures import shipped_drafter

pytest_plugins = ["tests.server.tiny_fixtures"]
ROUNDS = 20


class NoisyOracle(OracleDrafter):
    """The oracle's logits plus seeded noise (no exact ties, so the device tree is the heap's)."""

    def propose(self, cache, ctx, bonus_token, start_pos):
        g = torch.Generator().manual_seed(start_pos)
        logits = super().propose(cache, ctx, bonus_token, start_pos)
        return logits + torch.randn(logits.shape, generator=g)


def _engine(model, tok, drafter, max_len, device_round=True, **kw):
    graphed = GraphedTarget(model, capture=False)
    eng = Engine(graphed, tok, drafter, max_model_len=max_len, max_running=1, **kw)
    runner = eng.batch.runner
    assert runner.solo is not None
    if not device_round:
        runner.solo = None
    else:
        calls = runner.device_rounds = []
        run = runner.solo.run
        runner.solo.run = lambda *a: calls.append(a[-1]) or run(*a)
    return eng


def _lockstep(dev, host, prompt, budget, rounds=ROUNDS, kv=True):
    """Step both engines until ``rounds`` decode rounds; compare after every step. Returns the tokens."""
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    reqs = [e.make_request(prompt, params, mode="ddtree", tree_budget=budget) for e in (dev, host)]
    for e, r in zip((dev, host), reqs):
        e.batch.add(r)
    got: list[list[int]] = [[], []]
    while reqs[0].rounds < rounds and not reqs[0].finished:
        for i, e in enumerate((dev, host)):
            got[i] += [t for _, ev in e.batch.step() for t in ev.token_ids]
        a, b = reqs
        assert got[0] == got[1] and a.s == b.s and a.bonus == b.bonus, (budget, a.rounds)
        ca, cb = dev.batch.runner.caches[0], host.batch.runner.caches[0]
        assert ca.length == cb.length
        if kv:
            assert torch.equal(ca.k[:, :, :ca.length], cb.k[:, :, :cb.length])
            assert torch.equal(ca.v[:, :, :ca.length], cb.v[:, :, :cb.length])
            assert (a.ctx is None) == (b.ctx is None) and (a.ctx is None or torch.equal(a.ctx, b.ctx))
        assert a.kinds == b.kinds and a.nodes == b.nodes
    for e, r in zip((dev, host), reqs):
        e.batch.abort(r)
    return got[0]


def _ar(model, tok, prompt, n, max_len):
    eng = Engine(GraphedTarget(model, capture=False), tok, max_model_len=max_len)
    return [t for ev in eng.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)) for t in ev.token_ids]


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_tiny_device_round_equals_host_round(dense, budget):
    tok, prompt = ByteTokenizer(), list(b"device rounds")
    ref = _ar(dense, tok, prompt, 200, 400)
    make = lambda: NoisyOracle(len(prompt), ref, vocab=VOCAB, hidden=64, layer_ids=[1, 2], block_size=8)  # noqa: E731
    dev, host = _engine(dense, tok, make(), 400), _engine(dense, tok, make(), 400, device_round=False)
    got = _lockstep(dev, host, prompt, budget)
    assert got == ref[:len(got)] and len(dev.batch.runner.device_rounds) >= ROUNDS
    assert len(got) > 1.5 * ROUNDS or budget == 1   # the oracle's trees are accepted: paths move rows
    dense.capture_layers = []


@pytest.mark.parametrize("budget", [16, 64])
def test_tied_drafts_still_give_plain_decoding(dense, budget):
    """The oracle's raw logits are mostly exact ties (zeros): the device tree may pick other tied
    prefixes than the heap, but the walk follows the target, so the tokens are ar's."""
    tok, prompt = ByteTokenizer(), list(b"tied drafts")
    ref = _ar(dense, tok, prompt, 120, 300)
    drafter = OracleDrafter(len(prompt), ref, vocab=VOCAB, hidden=64, layer_ids=[1, 2], block_size=8)
    eng = _engine(dense, tok, drafter, 300)
    toks = [t for ev in eng.generate(prompt, SamplingParams(max_tokens=120, ignore_eos=True), mode="ddtree",
                                     tree_budget=budget) for t in ev.token_ids]
    assert toks == ref and len(eng.batch.runner.device_rounds) < 60   # accepted paths
    dense.capture_layers = []


def test_tiny_near_the_length_limit_and_fallback(dense):
    """Room below the budget: the device round's live nodes are capped (the padded graph of the
    budget); a budget past the target's largest bucket keeps the host round. Tokens equal ar."""
    tok, prompt = ByteTokenizer(), list(b"the end")
    ref = _ar(dense, tok, prompt, 100, 60)
    for budget, buckets in ((16, None), (40, (1, 2, 4, 8, 16))):
        drafter = NoisyOracle(len(prompt), ref, vocab=VOCAB, hidden=64, layer_ids=[1, 2], block_size=8)
        graphed = GraphedTarget(dense, capture=False, **({"buckets": buckets} if buckets else {}))
        eng = Engine(graphed, tok, drafter, max_model_len=60)
        calls, run = [], eng.batch.runner.solo.run
        eng.batch.runner.solo.run = lambda *a, run=run, calls=calls: calls.append(a[-1]) or run(*a)
        toks = [t for ev in eng.generate(prompt, SamplingParams(max_tokens=100, ignore_eos=True), mode="ddtree",
                                         tree_budget=budget) for t in ev.token_ids]
        assert toks == ref, budget
        assert calls and (min(calls) < budget if buckets is None else True)
    dense.capture_layers = []


def test_sampled_processed_and_hybrid_rounds_keep_the_host_round(dense, hybrid):
    """A sampled request (T > 0) and one with a logits processor (logprobs) never take the device
    round and give the host round's tokens; a hybrid target has no device round."""
    from ddtree_server.models.hybrid.graphs import GraphedHybrid

    tok, prompt = ByteTokenizer(), list(b"sampled")
    ref = _ar(dense, tok, prompt, 60, 200)
    for params in (SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True),
                   SamplingParams(max_tokens=40, logprobs=2, ignore_eos=True)):
        outs = []
        for device_round in (True, False):
            drafter = NoisyOracle(len(prompt), ref, vocab=VOCAB, hidden=64, layer_ids=[1, 2], block_size=8)
            eng = _engine(dense, tok, drafter, 200, device_round)
            outs.append([t for ev in eng.generate(prompt, params, mode="ddtree", tree_budget=8) for t in ev.token_ids])
            if device_round:
                assert eng.batch.runner.device_rounds   # asked, and declined (None)
        assert outs[0] == outs[1] and len(outs[0]) == 40
    drafter = NoisyOracle(len(prompt), ref, vocab=VOCAB, hidden=64, layer_ids=[1, 2], block_size=8)
    assert Engine(GraphedHybrid(hybrid, capture=False), tok, drafter, max_model_len=100).batch.runner.solo is None
    dense.capture_layers = []


@pytest.fixture(scope="module")
def shipped(smollm2):
    d = shipped_drafter(smollm2)
    yield d
    smollm2.model.capture_layers = []


SMOL_PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively."
SMOL_ROUNDS = 12   # SmolLM2's rounds cost ~0.5 s each; the tiny target above runs ROUNDS at every budget


@pytest.fixture(scope="module")
def smol_ar(smollm2):
    """Plain decoding's tokens of the prompt on the same (static-path) target: 64, more than the
    test's SMOL_ROUNDS rounds emit (52 at budget 64; more would fail its ``len(got) <= len(ar)``)."""
    eng = Engine(GraphedTarget(smollm2.model, capture=False), smollm2.tokenizer, max_model_len=256)
    ids = eng.encode(SMOL_PROMPT)
    return ids, [t for ev in eng.generate(ids, SamplingParams(max_tokens=64, ignore_eos=True)) for t in ev.token_ids]


@pytest.mark.slow
@pytest.mark.parametrize("budget", [4, 64])   # every budget 1-64 on the tiny target above (cheap)
def test_smollm2_device_round_equals_host_round(smollm2, shipped, smol_ar, budget):
    kw = {"eos_token_ids": smollm2.eos_token_ids}
    dev = _engine(smollm2.model, smollm2.tokenizer, shipped, 256, **kw)
    host = _engine(smollm2.model, smollm2.tokenizer, shipped, 256, device_round=False, **kw)
    prompt, ar = smol_ar
    got = _lockstep(dev, host, prompt, budget, rounds=SMOL_ROUNDS)
    assert len(dev.batch.runner.device_rounds) >= SMOL_ROUNDS
    assert len(got) <= len(ar) and got == ar[:len(got)]   # the engine's tokens are plain decoding's
    assert len(got) > (1.5 if budget > 1 else 1.2) * SMOL_ROUNDS   # the shipped drafter is accepted


def test_bench_stages_of_the_device_round():
    """``bench --random-shape`` times the device round and the runner's rounds with / without it
    when the target is graphed (here the static path run eagerly on the CPU)."""
    from ddtree_server.bench.random_shape import StageOptions, run_random_shape
    from ddtree_server.bench.shapes import get_shape
    from ddtree_server.models.random_init import drafter_from_config, target_from_config

    shape = get_shape("tiny")
    target = target_from_config(shape.target, device="cpu", dtype="fp32")
    drafter = drafter_from_config(shape.drafter, target, device="cpu", dtype="fp32", seed=1)
    eng = Engine(GraphedTarget(target, capture=False), None, drafter, max_model_len=200, eos_token_ids=[],
                 max_running=1)
    doc = run_random_shape(shape, StageOptions(context=24, iters=2, warmup=1, budgets=(4,)), device="cpu",
                           engine=eng, tau={"ddtree": 2.0}, log=lambda s: None)
    stages = doc["stages"]
    assert {"device_round_4", "round_ddtree_4_device", "round_ddtree_4_host"} <= set(stages)
    assert stages["device_round_4"]["rows"] == 5 and stages["device_round_4"]["weight_bytes"] > 0
    assert "ddtree-4_device" in doc["derived"]["projected_speedup"]


class _Boost:
    """Wraps a drafter's propose: the known greedy continuation ``ref`` raised to the top of two
    draft rows in three, below a decoy in the second (so random weights accept paths through
    second-ranked nodes and the commit moves rows)."""

    def __init__(self, propose, prompt_len, ref):
        self.propose, self.prompt_len, self.ref = propose, prompt_len, ref

    def __call__(self, cache, ctx, bonus_token, start_pos):
        logits = self.propose(cache, ctx, bonus_token, start_pos).clone()
        for j in range(logits.shape[0]):
            idx = start_pos + j + 1 - self.prompt_len
            if 0 <= idx < len(self.ref) and idx % 3:
                top = logits[j].max()
                logits[j, self.ref[idx]] = top + 4.0
                if idx % 3 == 2:
                    logits[j, (self.ref[idx] + 1) % logits.shape[1]] = top + 4.5
        return logits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("budget", [16, 64])
def test_cuda_graph_replay_equals_eager_device_round(budget):
    """SmolLM2-shaped random weights (fp32, the kernel path): the device round replayed from its CUDA
    graph gives bitwise the tokens, live K/V rows and context rows of the same round run eagerly,
    over 30 rounds."""
    from ddtree_server.bench.shapes import get_shape
    from ddtree_server.engine.batch.solo_round import SoloRound
    from ddtree_server.models.random_init import drafter_from_config, target_from_config

    shape = get_shape("smollm2-135m")
    target = target_from_config(shape.target, device="cuda", dtype="fp32")
    drafter = drafter_from_config(shape.drafter, target, device="cuda", dtype="fp32", seed=1)
    prompt = torch.randint(0, shape.target["vocab_size"], (100,), generator=torch.Generator().manual_seed(0)).tolist()
    make = lambda: Engine(target, None, drafter, max_model_len=1024, eos_token_ids=[], max_running=1)  # noqa: E731
    ar = make()
    req = ar.make_request(prompt, SamplingParams(max_tokens=400, ignore_eos=True), mode="ar")
    req.slot = 0
    ar.batch.runner.prefill(req)
    ref = [req.bonus]
    with torch.inference_mode():
        while len(ref) < 400:
            ref += ar.batch.runner.round([req])[0]
    graph, eager = make(), make()
    assert graph.batch.runner.solo.capture
    eager.batch.runner.solo = SoloRound(eager.target, capture=False)
    reqs = []
    for e in (graph, eager):
        e.drafter.propose = _Boost(e.drafter.propose, len(prompt), ref)
        r = e.make_request(prompt, SamplingParams(max_tokens=400, ignore_eos=True), mode="ddtree", tree_budget=budget)
        r.slot = 0
        e.batch.runner.prefill(r)
        reqs.append(r)
    got = [[reqs[0].bonus], [reqs[1].bonus]]
    with torch.inference_mode():
        for _ in range(30):
            for i, e in enumerate((graph, eager)):
                got[i] += e.batch.runner.round([reqs[i]])[0]
            a, b = reqs
            ca, cb = graph.batch.runner.caches[0], eager.batch.runner.caches[0]
            assert got[0] == got[1] and a.s == b.s == ca.length == cb.length
            assert torch.equal(ca.k[:, :, :a.s], cb.k[:, :, :b.s]) and torch.equal(ca.v[:, :, :a.s], cb.v[:, :, :b.s])
            assert torch.equal(a.ctx, b.ctx)
    assert got[0] == ref[:len(got[0])]   # greedy: the tokens are plain decoding's
    assert len(got[0]) > 45   # the boosted drafts are accepted (paths of several rows)
    target.capture_layers = []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("budget", [16, 64])
def test_cuda_smollm2_device_round_equals_host_round(budget):
    """The real SmolLM2 + shipped drafter on CUDA in fp32 with CUDA graphs: the device round gives
    the host round's tokens, cache and context rows over 30 rounds, and plain decoding's tokens."""
    from ddtree_server.models.default import DEFAULT_GGUF_SHA256, DefaultModelError, default_gguf_path
    from ddtree_server.models.load import load_target

    try:
        loaded = load_target(gguf=default_gguf_path(verify=True), gguf_sha256=DEFAULT_GGUF_SHA256, device="cuda",
                             dtype="fp32")
    except DefaultModelError as exc:
        pytest.skip(str(exc))
    model = loaded.model
    drafter = shipped_drafter(loaded, device="cuda", dtype=torch.float32)
    make = lambda: Engine(model, loaded.tokenizer, drafter, max_model_len=512, max_running=1,  # noqa: E731
                          eos_token_ids=loaded.eos_token_ids)
    dev, host = make(), make()
    assert dev.batch.runner.solo is not None and dev.batch.runner.solo.capture
    host.batch.runner.solo = None
    prompt = dev.encode(SMOL_PROMPT)
    got = _lockstep(dev, host, prompt, budget, rounds=30)
    ar = [t for ev in dev.generate(prompt, SamplingParams(max_tokens=len(got), ignore_eos=True), mode="ar")
          for t in ev.token_ids]
    assert got == ar and len(got) > 45
