"""The speculation gate (engine/batch/gate.py): speculative or plain rounds, by measured speed.

Bookkeeping: the faster arm wins per batch bucket, the slower one is tried again on a doubling
schedule, a capture-like outlier is not counted. Through the engine (fp32 CPU, tiny dense and
hybrid targets): a scripted schedule of plain and speculative rounds gives the tokens of ``ar``;
the context rows that requests gather in plain rounds go into their drafter cache (the fold) with
the same K/V the drafter appends itself; a useless drafter is gated off on wall-clock timing, an
oracle one kept.
"""

from __future__ import annotations

import pytest
import torch
from ddtree_server.engine.batch.gate import MAX, MIN, TRY_COST, WARMUP, SpecGate, bucket_of
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams

from tests.server.batch_fixtures import LAYERS, MAX_LEN, oracle_drafter, random_specs, real_drafter, run_alone
from tests.server.tiny import EOS, ByteTokenizer

pytest_plugins = ["tests.server.tiny_fixtures"]   # the dense / hybrid module fixtures


# ---------------------------------------------------------------------------- bookkeeping
def _drive(gate: SpecGate, batch: int, rounds: int, spec_speed: float, plain_speed: float) -> list[bool]:
    """``rounds`` rounds where a round of each arm runs at the given tokens/s (1 s rounds)."""
    out = []
    for _ in range(rounds):
        c = gate.choose(batch)
        gate.observe(batch, c, int(spec_speed if c else plain_speed), 1.0)
        out.append(c)
    return out


def test_the_faster_arm_wins_per_bucket_and_the_slower_is_retried_less_and_less():
    gate = SpecGate()
    low = _drive(gate, 1, 600, spec_speed=300, plain_speed=100)     # batch 1: speculation pays
    high = _drive(gate, 60, 600, spec_speed=500, plain_speed=900)   # batch 60: plain decoding pays
    assert low[:WARMUP] == [True] * WARMUP and high[:WARMUP] == [True] * WARMUP
    assert high[WARMUP:2 * WARMUP] == [False] * WARMUP               # then the other arm is measured
    assert sum(low[50:]) >= len(low[50:]) - 6 and sum(high[50:]) <= 6
    assert gate.buckets[bucket_of(60)].interval == MAX               # every try confirmed the winner
    tries = [i for i, c in enumerate(high) if c and i >= 2 * WARMUP]
    assert tries and all(b - a >= MIN for a, b in zip(tries, tries[1:]))
    snap = gate.snapshot()
    assert snap[1]["speculating"] and not snap[64]["speculating"] and snap[64]["plain"] == 900.0


def test_a_change_of_speed_is_followed():
    gate = SpecGate()
    _drive(gate, 8, 300, spec_speed=900, plain_speed=500)
    assert gate.choose(8)
    late = _drive(gate, 8, 400, spec_speed=200, plain_speed=500)   # the drafter stopped helping
    assert sum(late[-100:]) <= 5
    back = _drive(gate, 8, 400, spec_speed=900, plain_speed=500)   # and helps again
    assert sum(back[-100:]) >= 95


def test_a_larger_batch_starts_plainly_above_a_plain_bucket_and_tries_stay_cheap():
    gate = SpecGate()
    _drive(gate, 8, 100, spec_speed=500, plain_speed=900)          # batch 8 runs plainly
    out = []
    for _ in range(600):   # batch 30: a speculative round takes 5 plain rounds' time for 2x the tokens
        c = gate.choose(30)
        gate.observe(30, c, 60 if c else 30, 5.0 if c else 1.0)
        out.append(c)
    assert out[:MIN] == [False] * MIN                                # no speculative warm-up
    assert 1 <= sum(out) <= WARMUP + 3, [i for i, c in enumerate(out) if c]
    bk = gate.buckets[32]
    assert not bk.winner and bk.interval >= (5.0 - 1.0) / TRY_COST - 1
    assert gate.choose(1)                                            # a smaller batch starts speculative


def test_heavy_tailed_gains_count_by_their_mean():
    """Most speculative rounds gain one token, every fourth gains twenty: 5.75 tokens a round on
    average beat 4 plain ones, although the median round gains less than a plain one."""
    gate, out = SpecGate(), []
    for _ in range(400):
        c = gate.choose(8)
        gate.observe(8, c, (20 if sum(out) % 4 == 3 else 1) if c else 4, 1.0)
        out.append(c)
    assert sum(out[100:]) >= len(out[100:]) - 6


def test_a_capture_like_round_is_not_counted():
    gate = SpecGate()
    _drive(gate, 4, 40, spec_speed=300, plain_speed=100)
    bk = gate.buckets[4]
    speed = bk.spec.speed
    gate.observe(4, True, 300, 60.0)   # a round that also captured CUDA graphs
    assert bk.spec.speed == speed and gate.choose(4) in (True, False)


# ---------------------------------------------------------------------------- through the engine
class Scripted(SpecGate):
    """A gate whose choices follow ``schedule(round index)`` (the rounds of a test, not timing)."""

    def __init__(self, schedule):
        super().__init__()
        self.schedule, self.rounds = schedule, 0

    def choose(self, batch: int) -> bool:
        self.rounds += 1
        return self.schedule(self.rounds - 1)


def _gated(target, drafter, gate, **kw) -> Engine:
    engine = Engine(target, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN, **kw)
    engine.batch.gate = gate
    return engine


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_plain_and_speculative_rounds_mixed_equal_ar(request, kind):
    """Stretches of plain rounds (longer than a block, so contexts fold) between speculative ones,
    random arrivals / budgets / modes / cancellations: every request's tokens equal ``ar``."""
    target = request.getfixturevalue(kind)
    engine = _gated(target, real_drafter(target), Scripted(lambda i: (i // 9) % 3 == 2), max_running=4,
                    poison_freed_slots=True)
    ar = Engine(target, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=1)
    specs = [s for s in random_specs(7 if kind == "dense" else 9, 12) if s["params"]["temperature"] == 0.0]
    batch = engine.batch
    reqs = []
    for s in specs:
        req = engine.make_request(s["prompt"], SamplingParams(**s["params"]), mode=s["mode"], tree_budget=s["budget"],
                                  rid=s["rid"])
        batch.add(req)
        reqs.append((s, req))
    while batch.busy:
        batch.step()
    for s, req in reqs:
        got = [t for ev in req.events for t in ev.token_ids]
        assert got == run_alone(ar, s, mode="ar")[0], s
    assert engine.batch.gate.rounds > 30
    target.capture_layers = []


def test_folded_context_equals_the_drafters_own_append(dense):
    """After a stretch of plain rounds, the drafter cache rows a request's context was folded into
    equal the rows the drafter writes itself when the context comes with its next proposal."""
    specs = [dict(prompt=list(f"fold {i} the cat".encode()), params=dict(max_tokens=60, ignore_eos=True))
             for i in range(3)]
    engines = []
    for fold in (True, False):
        engine = _gated(dense, real_drafter(dense), Scripted(lambda i: i == 0 or i >= 25), max_running=3)
        if not fold:
            engine.batch.runner._fold = lambda reqs: None
        reqs = [engine.make_request(s["prompt"], SamplingParams(**s["params"]), mode="ddtree", tree_budget=4)
                for s in specs]
        for r in reqs:
            engine.batch.add(r)
        engines.append((engine, reqs))
    (a, ra), (b, rb) = engines
    seen_fold = False
    while a.batch.busy or b.batch.busy:
        a.batch.step()
        b.batch.step()
        for x, y in zip(ra, rb):
            assert [e.token_ids for e in x.events] == [e.token_ids for e in y.events]
            if x.finished or x.slot is None:
                continue
            if x.ctx is not None and x.rounds > 1:
                assert x.ctx.shape[0] <= a.block_size        # folded: pending rows stay within a block
                seen_fold |= a.batch.runner.dcaches[x.slot].length > b.batch.runner.dcaches[y.slot].length
            ca, cb = a.batch.runner.dcaches[x.slot], b.batch.runner.dcaches[y.slot]
            n = min(ca.length, cb.length)
            if n:
                ka, kb = ca.k[:, :, :n], cb.k[:, :, :n]
                assert torch.allclose(ka, kb, atol=1e-5), (x.rid, n)
    assert seen_fold
    dense.capture_layers = []


def test_a_useless_drafter_is_gated_off_an_oracle_kept(dense):
    """Real wall-clock timing on the CPU: a random-weight drafter (nothing accepted) makes
    speculative rounds slower than plain ones, so most late rounds run plain; the oracle TEST
    DOUBLE (everything accepted) keeps speculating. Both equal ``ar``."""
    prompts = [list(f"gate {i} alpha beta".encode()) for i in range(4)]
    params = SamplingParams(max_tokens=90, ignore_eos=True)
    oracle_params = SamplingParams(max_tokens=160, ignore_eos=True)
    engine = _gated(dense, real_drafter(dense), SpecGate(), max_running=4)
    reqs = [engine.make_request(p, params, mode="ddtree", tree_budget=5) for p in prompts]
    for r in reqs:
        engine.batch.add(r)
    plain = []
    while engine.batch.busy:
        engine.batch.step()
        if engine.batch.last.kinds:
            plain.append(engine.batch.last.kinds["plain"] == engine.batch.last.batch)
    late = plain[20:]
    assert sum(late) >= 0.7 * len(late), plain
    ar = Engine(dense, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=1)
    for p, r in zip(prompts, reqs):
        want = [t for ev in ar.generate(p, params, mode="ar") for t in ev.token_ids]
        assert [t for ev in r.events for t in ev.token_ids] == want

    dense.capture_layers = LAYERS
    specs = [dict(rid=f"o{i}", prompt=p, mode="ddtree", budget=8, params=dict(max_tokens=160, ignore_eos=True))
             for i, p in enumerate(prompts)]
    drafter, _ = oracle_drafter(dense, specs)
    engine = _gated(dense, drafter, SpecGate(), max_running=4)
    for s in specs:
        engine.batch.add(engine.make_request(s["prompt"], oracle_params, mode="ddtree", tree_budget=8))
    spec = []
    while engine.batch.busy:
        engine.batch.step()
        if engine.batch.last.kinds:
            spec.append(engine.batch.last.kinds["plain"] == 0)
    assert sum(spec) >= 0.7 * len(spec), spec
    dense.capture_layers = []


def test_bench_runs_the_gate_as_a_method(dense):
    from ddtree_server.bench.concurrency import closed_loop

    engine = Engine(dense, ByteTokenizer(), real_drafter(dense), eos_token_ids=[EOS], max_model_len=MAX_LEN,
                    max_running=3)
    prompts = [list(f"bench {i} gate".encode()) for i in range(4)]
    row = closed_loop(engine, prompts, mode="gate", budget=4, concurrency=3, max_new_tokens=40)
    fixed = closed_loop(engine, prompts, mode="ddtree", budget=4, concurrency=3, max_new_tokens=40)
    assert row["requests"] == fixed["requests"] == 4 and row["tokens"] == fixed["tokens"] > 40
    assert 0.0 < row["gate_plain_share"] < 1.0 and fixed["gate_plain_share"] is None
    assert engine.batch.gate is None   # the run's gate is not left behind
    dense.capture_layers = []
