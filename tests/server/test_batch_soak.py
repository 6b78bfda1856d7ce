"""Soak: thousands of requests through the batch engine leave every slot (and, in the paged KV
layout, every page) free, and no step breaks the bookkeeping on the way (CPU fp32, tiny dense target, the
real DFlash drafter with random weights).

Random prompt lengths (chunked prefill: a step's prompt-token budget splits prompts over several steps),
modes (plain / DFlash / DDTree), ``max_tokens``, cancellations while queued, while prefilling and
while decoding, and consumers that go away (``abort``). After every step: each slot is either free
or held by exactly one running request, no request is both queued and running, a finished request
holds no slot, the memory snapshot counts the running requests; at the end every slot is free and
freed slots are poisoned with NaN all along (the debug mode of the engine). The paged layout runs
on pages for about a fifth of the slots' need, a fifth of its requests generating 48 tokens, so
rounds shrink and requests are preempted and recomputed all along; its page bookkeeping is verified after every change (the same debug mode),
and after every step no page is held by a slot without a running request. A tiny hybrid target
runs the paged soak too (its attention K/V in pages, its GDN states per slot), fewer requests.
"""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams

from tests.server.batch_fixtures import real_drafter
from tests.server.hybrid_fixtures import tiny_hybrid
from tests.server.tiny import EOS, ByteTokenizer, tiny_target

# 0-18 arrivals a step and a 96-token prefill budget: half the steps of 0-9 and 48 (each step's
# forwards cost about the same however full); the queue still backs up (cancellations while queued)
REQUESTS, SLOTS, CHUNK, ARRIVALS, PICKS = 10_000, 32, 96, 18, 4
PAGES = 48   # 47 pages of 16 rows for 32 slots of up to 97 rows (7 pages each): about a fifth
# the suite's sizes (the paged soak verifies its pages after every change: 10,000 requests take
# ~150 s there), or DDTREE_SOAK_REQUESTS for both layouts (docs/architecture.md, "Tests")
LONG = int(os.environ.get("DDTREE_SOAK_REQUESTS", "0") or 0)


def _check(batch, live: dict) -> None:
    sched = batch.scheduler
    held = [r.slot for r in sched.running]
    assert None not in held and len(set(held)) == len(held)
    assert sorted(held + list(sched._free)) == list(range(SLOTS))
    assert not set(map(id, sched.waiting)) & set(map(id, sched.running))
    assert all(r.slot is None for r in sched.waiting)
    assert batch.memory.used == len(sched.running) and batch.memory.slots == SLOTS
    for req in live.values():
        if req.finished:
            assert req.slot is None and req not in sched.running
    if batch.admission is not None:
        assert set(batch.admission.pages.tables) <= set(held)
        assert batch.memory.kv_pages_used + batch.memory.kv_pages_free == PAGES - 1


@pytest.mark.slow
@pytest.mark.parametrize("layout,kind,requests", [("slot", "dense", LONG or REQUESTS), ("paged", "dense", LONG or 3_000),
                                                 ("paged", "hybrid", LONG or 1_000)])
def test_thousands_of_requests_leave_every_slot_and_page_free(layout, kind, requests):
    torch.set_num_threads(1)
    target = tiny_target() if kind == "dense" else tiny_hybrid("3gdn+attn", seed=21)
    engine = Engine(target, ByteTokenizer(), real_drafter(target), eos_token_ids=[EOS], max_model_len=96,
                    max_running=SLOTS, poison_freed_slots=True, prefill_chunk=CHUNK, kv_layout=layout,
                    kv_pages=PAGES if layout == "paged" else None)
    batch, rng = engine.batch, random.Random(10)
    live: dict[str, object] = {}
    sent = finished = aborted = 0
    while sent < requests or batch.busy:
        for _ in range(rng.randint(0, ARRIVALS) if sent < requests else 0):
            prompt = [rng.randrange(3, 250) for _ in range(rng.choice([1, 5, 15, 16, 17, 40]))]
            mode = rng.choice(["ar", "dflash", "ddtree"])
            most = 48 if layout == "paged" and rng.random() < 0.2 else rng.randint(1, 4)   # long ones: preemptions
            req = engine.make_request(prompt, SamplingParams(max_tokens=most, ignore_eos=True),
                                      mode=mode, tree_budget=rng.choice([2, 8]) if mode == "ddtree" else None,
                                      cancel=threading.Event(), rid=f"r{sent}")
            batch.add(req)
            live[req.rid] = req
            sent += 1
        for req in rng.sample(list(live.values()), k=min(len(live), PICKS)):
            roll = rng.random()
            if roll < 0.03:
                req.cancel.set()                       # queued, prefilling or decoding
            elif roll < 0.05:
                batch.abort(req)                       # the consumer went away
                aborted += 1
        for req, ev in batch.step():
            if ev.finish_reason:
                finished += 1
                for t in ev.token_ids:
                    assert 0 <= t < 260
        _check(batch, live)
        for rid in [rid for rid, r in live.items() if r.finished]:
            del live[rid]
    assert sorted(batch.scheduler._free) == list(range(SLOTS)) and not batch.scheduler.running
    assert finished + aborted >= requests * 0.95 and batch.memory.used == 0
    if layout == "paged":
        pages = batch.admission.pages
        pages.verify()
        assert pages.tables == {} and pages.free_pages == PAGES - 1
        assert batch.preemptions > requests // 300 and batch.admission.shrunk > requests // 20
