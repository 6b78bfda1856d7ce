"""Soak: 10,000 requests through the batch engine leave every slot free, and no step breaks the
slot bookkeeping on the way (CPU fp32, tiny dense target, the real DFlash drafter with random
weights).

Random prompt lengths (chunked prefill: a step's prompt-token budget splits prompts over several steps),
modes (plain / DFlash / DDTree), ``max_tokens``, cancellations while queued, while prefilling and
while decoding, and consumers that go away (``abort``). After every step: each slot is either free
or held by exactly one running request, no request is both queued and running, a finished request
holds no slot, the memory snapshot counts the running requests; at the end every slot is free and
freed slots are poisoned with NaN all along (the debug mode of the engine).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams

from tests.server.batch_fixtures import real_drafter
from tests.server.tiny import EOS, ByteTokenizer, tiny_target

# 0-18 arrivals a step and a 96-token prefill budget: half the steps of 0-9 and 48 (each step's
# forwards cost about the same however full); the queue still backs up (cancellations while queued)
REQUESTS, SLOTS, CHUNK, ARRIVALS, PICKS = 10_000, 32, 96, 18, 4


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


@pytest.mark.slow
def test_ten_thousand_requests_leave_every_slot_free():
    torch.set_num_threads(1)
    target = tiny_target()
    engine = Engine(target, ByteTokenizer(), real_drafter(target), eos_token_ids=[EOS], max_model_len=96,
                    max_running=SLOTS, poison_freed_slots=True, prefill_chunk=CHUNK)
    batch, rng = engine.batch, random.Random(10)
    live: dict[str, object] = {}
    sent = finished = aborted = 0
    while sent < REQUESTS or batch.busy:
        for _ in range(rng.randint(0, ARRIVALS) if sent < REQUESTS else 0):
            prompt = [rng.randrange(3, 250) for _ in range(rng.choice([1, 5, 15, 16, 17, 40]))]
            mode = rng.choice(["ar", "dflash", "ddtree"])
            req = engine.make_request(prompt, SamplingParams(max_tokens=rng.randint(1, 4), ignore_eos=True),
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
    assert finished + aborted >= REQUESTS * 0.95 and batch.memory.used == 0
