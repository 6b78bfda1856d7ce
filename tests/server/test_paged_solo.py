"""engine/batch/paged_solo.py: a lone request's DDTree (or DFlash) round on the paged layout, all on the device,
equals the batched round it replaces (fp32, CPU, eager; on CUDA the same code is one CUDA graph:
test_paged_gpu.py).

Two paged engines over the same weights step in lockstep, one with the device round (device tree,
a one-block layout built on the device, the batched forward through the page table, device walk,
fixed-shape commit through the page table), one without (the batched round: trees copied back,
host layout, walk, ``commit_paths``). After every step the emitted tokens, the request's state,
its tree kinds and sizes and its committed K/V rows read through the page table agree, and the
tokens are plain decoding's. Freed pages are NaN (the debug mode), so a read of a page the
request does not hold shows."""

from __future__ import annotations

import pytest
import torch

from ddtree_server.engine.batch.pages import PAGE_SIZE
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams
from tests.server.test_solo_round import NoisyOracle
from tests.server.tiny import VOCAB, ByteTokenizer

pytest_plugins = ["tests.server.tiny_fixtures"]
ROUNDS = 20


def _ar(model, prompt, n, max_len):
    eng = Engine(model, ByteTokenizer(), max_model_len=max_len)
    return [t for ev in eng.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)) for t in ev.token_ids]


def _paged(model, drafter, max_len, device_round=True):
    eng = Engine(model, ByteTokenizer(), drafter, max_model_len=max_len, max_running=2, kv_layout="paged",
                 kv_pages=2 * (-(-(max_len + 1) // PAGE_SIZE)) + 1, poison_freed_slots=True)
    runner = eng.batch.runner
    assert runner.paged_solo is not None
    if not device_round:
        runner.paged_solo = None
    else:
        calls = runner.device_rounds = []
        run = runner.paged_solo.run
        runner.paged_solo.run = lambda *a: calls.append(run(*a)) or calls[-1]
    return eng


def _rows(eng, req) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's committed K/V rows ``[layers, kv_heads, s, d]`` through its page table."""
    slots = eng.batch.runner.caches
    table = slots.host_table(req.slot)
    pos = torch.arange(req.s)
    page, row = table[pos // PAGE_SIZE], pos % PAGE_SIZE
    return tuple(slots.pool(n)[:, page, :, row].permute(1, 2, 0, 3) for n in ("k", "v"))


def _oracle(prompt, ref):
    return NoisyOracle(len(prompt), ref, vocab=VOCAB, hidden=64, layer_ids=[1, 2], block_size=8)


@pytest.mark.parametrize("mode,budget", [("ddtree", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64),
                                         ("dflash", 64), ("dflash", 3)])   # a DFlash chain cut to 3 of its 7 drafts
def test_lone_paged_device_round_equals_the_batched_round(dense, mode, budget):
    dense.capture_layers = [1, 2]
    prompt = list(b"paged device rounds")
    ref = _ar(dense, prompt, 200, 400)
    dev, host = _paged(dense, _oracle(prompt, ref), 400), _paged(dense, _oracle(prompt, ref), 400, device_round=False)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    reqs = [e.make_request(prompt, params, mode=mode, tree_budget=budget) for e in (dev, host)]
    for e, r in zip((dev, host), reqs):
        e.batch.add(r)
    got: list[list[int]] = [[], []]
    while reqs[0].rounds < ROUNDS:
        for i, e in enumerate((dev, host)):
            got[i] += [t for _, ev in e.batch.step() for t in ev.token_ids]
        a, b = reqs
        assert got[0] == got[1] and (a.s, a.bonus, a.kinds, a.nodes) == (b.s, b.bonus, b.kinds, b.nodes), a.rounds
        assert dev.batch.runner.caches[a.slot].length == a.s
        for x, y in zip(_rows(dev, a), _rows(host, b)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        assert (a.ctx is None) == (b.ctx is None)
        if a.ctx is not None:
            torch.testing.assert_close(a.ctx, b.ctx, rtol=1e-5, atol=1e-5)
    assert got[0] == ref[:len(got[0])]
    done = [c for c in dev.batch.runner.device_rounds if c is not None]
    assert len(done) >= ROUNDS - 1   # the first round after the prompt may be a plain one
    assert len(got[0]) > 1.5 * ROUNDS or budget == 1   # trees accepted: the commit moved rows
    if mode == "dflash":
        assert a.kinds["chain"] >= ROUNDS - 1 and a.kinds["tree"] == 0, a.kinds
    elif budget >= 16:
        assert a.kinds["tree"] >= ROUNDS // 2, a.kinds
    dense.capture_layers = []


def test_requests_in_turn_and_the_end_of_the_context(dense):
    """Three requests one after another on reused pages, each decoding to the end of a short
    context: rounds whose rows pass the page table's width take the batched path. Tokens equal ar."""
    dense.capture_layers = [1, 2]
    max_len, budget = 120, 64
    eng = _paged(dense, _oracle([], []), max_len)
    for i, prompt in enumerate((list(b"first"), list(b"the second one"), list(b"3"))):
        ref = _ar(dense, prompt, 200, max_len)
        eng.batch.runner.drafter = _oracle(prompt, ref)
        toks = [t for ev in eng.generate(prompt, SamplingParams(max_tokens=200, ignore_eos=True), mode="ddtree",
                                         tree_budget=budget) for t in ev.token_ids]
        assert toks == ref[:len(toks)] and len(toks) == max_len - len(prompt), i
    calls = eng.batch.runner.device_rounds
    assert sum(c is not None for c in calls) >= 6 and sum(c is None for c in calls) >= 3
    pages = eng.batch.runner.caches.pages
    pages.verify()
    assert pages.tables == {}
    dense.capture_layers = []
