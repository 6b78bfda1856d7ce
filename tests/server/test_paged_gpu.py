"""The paged KV layout on CUDA (skipped without one): the batched rounds replay CUDA graphs whose
page tables are static inputs (engine/batch/graphs.py), the attention kernel reads K/V through
them (kernels/attention_batch.py), and with few pages admission holds requests back. Every
request's tokens equal the slot layout's for the same request alone (a tiny fp32 target, dense or
hybrid, with a random-weight DFlash drafter: chains and trees every round)."""

from __future__ import annotations

import pytest
import torch
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams

from tests.server.test_graph_out import _engine_and_jobs
from tests.server.batch_fixtures import run_together

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("pages", [60, 9])   # 60: every slot at max_model_len (7 pages each); 9: a few
def test_cuda_paged_graph_rounds_equal_the_slot_layout_alone(pages, kind):
    from tests.server.hybrid_fixtures import tiny_hybrid_ours

    slot, jobs, params = _engine_and_jobs(target=tiny_hybrid_ours(device="cuda") if kind == "hybrid" else None)
    target, drafter = slot.target, slot.drafter
    paged = Engine(getattr(target, "model", target), slot.tokenizer, drafter.drafter if hasattr(drafter, "drafter")
                   else drafter, eos_token_ids=slot.eos_token_ids, max_model_len=96, max_running=6,
                   kv_layout="paged", kv_pages=pages, poison_freed_slots=True)
    # (not 0: on CUDA that is what half the free memory holds, millions of pages of a tiny model,
    # each change then verified over all of them in the debug mode)
    lengths = [6 + 5 * ((i + 1) % 4) for i in range(len(jobs))]
    alone = [[x for ev in slot.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True), mode=m)
              for x in ev.token_ids] for (ids, m), n in zip(jobs, lengths)]
    batched, sizes = run_together(paged, jobs, params)
    assert batched == alone and max(sizes) > 1
    graphs = paged.batch.runner.graphs
    assert graphs is not None and graphs._static, "the paged rounds were captured"
    if kind == "hybrid":
        assert graphs.pending_rounds > 0, "rounds of chains and trees through the pages"
    pool = paged.batch.runner.caches.pages
    pool.verify()
    assert pool.free_pages == pool.num_pages - 1
    if pages == 9:   # 8 usable pages: admission (a page left per running request) holds the batch to 4 of 6 slots
        assert max(sizes) == 4
    else:
        assert max(sizes) == 6


def test_cuda_auto_layout_takes_pages_when_the_slots_would_not_hold_the_batch():
    """``auto``: a batch of 64 at max_model_len does not fit a millionth of the free memory (pages);
    one request does fit half of it (slots: the lone request's faster graphs)."""
    slot, _, _ = _engine_and_jobs()
    target = getattr(slot.target, "model", slot.target)

    def build(**kw):
        return Engine(target, slot.tokenizer, None, eos_token_ids=slot.eos_token_ids, max_model_len=96, **kw)
    assert build(kv_memory_fraction=1e-6).kv_layout == "paged"
    assert build(max_running=1).kv_layout == "slot"
    assert build(max_running=2, kv_layout="slot", kv_memory_fraction=1e-6).kv_layout == "slot"


@pytest.mark.parametrize("mode,budget", [("ddtree", 16), ("ddtree", 64), ("dflash", 64)])
def test_cuda_lone_paged_rounds_replay_one_graph(mode, budget):
    """A lone greedy DDTree / DFlash request on pages: its rounds after the drafter are one CUDA graph each
    (engine/batch/paged_solo.py), requests one after another on reused pages; the tokens are plain
    decoding's on the slot layout."""
    slot, jobs, _ = _engine_and_jobs()
    target = getattr(slot.target, "model", slot.target)
    drafter = slot.drafter.drafter if hasattr(slot.drafter, "drafter") else slot.drafter
    paged = Engine(target, slot.tokenizer, drafter, eos_token_ids=slot.eos_token_ids, max_model_len=96,
                   max_running=2, kv_layout="paged", kv_pages=20, poison_freed_slots=True)
    solo = paged.batch.runner.paged_solo
    assert solo is not None and solo.capture
    calls, run = [], solo.run
    solo.run = lambda *a: calls.append(run(*a)) or calls[-1]
    for ids, _ in jobs[:4]:
        p = SamplingParams(max_tokens=40, ignore_eos=True)
        want = [x for ev in slot.generate(ids, p, mode="ar") for x in ev.token_ids]
        got = [x for ev in paged.generate(ids, p, mode=mode, tree_budget=budget) for x in ev.token_ids]
        assert got == want
    assert sum(c is not None for c in calls) >= 20
    assert any(rd.graph is not None for rd in solo._rounds.values())
    pool = paged.batch.runner.caches.pages
    pool.verify()
    assert pool.free_pages == pool.num_pages - 1
