"""Chunked prefill in the server: the stall rule and the slot memory in /metrics.

A long prompt's chunked prefill keeps the worker's stall rule fed: each chunk is its own engine
step, so the round age the rule reads restarts at every chunk (no layer beacon needed). The real
Worker, app and tiny Engine (tests/server/api_tiny.py) with ``prefill_chunk`` 8: every prompt
chunk is slowed by a sleep so that the whole prefill lasts longer than ``--stall-seconds`` while
no single step does; /health must never report a stall and each chunk must start a new round.
/metrics then shows the slots' memory (``BatchEngine.memory``), and ``--kv-memory-fraction``
sizes the CUDA default of ``--max-running``.
"""

from __future__ import annotations

import time

from ddtree_server.engine.engine import Engine
from tests.server.api_tiny import MAX_MODEL_LEN, MODEL_ID, TinyApp, TinyTokenizer
from tests.server.tiny import EOS, tiny_target

CHUNK, SLEEP_S, STALL_S = 8, 0.4, 1.5


def test_long_prefill_in_chunks_is_not_a_stall():
    engine = Engine(tiny_target(), TinyTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_MODEL_LEN,
                    model_id=MODEL_ID, prefill_chunk=CHUNK)
    app = TinyApp(engine, stall_seconds=STALL_S)
    runner, seen = engine.batch.runner, []
    prefill = runner.prefill

    def slow_prefill(req, n=None):
        time.sleep(SLEEP_S)   # a slow chunk: a long prompt on a slow device
        seen.append((time.monotonic() - (app.worker.round_age() or 0.0), app.worker.stalled(),
                     app.worker.unhealthy_reason()))
        return prefill(req, n)

    runner.prefill = slow_prefill
    prompt = "x" * 60   # 60 tokens: 8 chunks, 3.2 s of prefill > --stall-seconds
    try:
        response = app.request("POST", "/v1/completions",
                               json={"model": MODEL_ID, "prompt": prompt, "max_tokens": 3, "temperature": 0})
        metrics = app.request("GET", "/metrics").text
    finally:
        app.stop()
    assert response.status_code == 200, response.text
    assert len(seen) == -(-60 // CHUNK) and len(seen) * SLEEP_S > STALL_S
    starts = [s for s, _, _ in seen]
    assert all(b > a for a, b in zip(starts, starts[1:]))   # every chunk in a new round
    assert not any(stalled or reason for _, stalled, reason in seen)
    # slot memory in /metrics: bytes per slot, slots used / free, KV rows, prompt tokens run
    slots, mem = engine.max_concurrency, engine.batch.memory
    assert mem.slot_bytes == engine.slot_bytes > 0 and mem.used == 0 and mem.kv_rows_used == 0
    for line in (f"ddtree_slot_bytes {float(engine.slot_bytes)}", 'ddtree_slots{state="used"} 0.0',
                 f'ddtree_slots{{state="free"}} {float(slots)}', "ddtree_kv_rows_used 0.0",
                 f"ddtree_kv_rows_capacity {float(slots * MAX_MODEL_LEN)}",
                 "ddtree_prefilling_requests 0.0", "ddtree_cuda_graph_pool_bytes 0.0",
                 "ddtree_eager_reserve_bytes 0.0", "ddtree_cuda_graphs_captured 0.0",
                 "ddtree_cuda_graph_declined_rounds 0.0"):   # the CPU: no graphs, nothing reserved
        assert line in metrics, line


def test_slot_memory_counts_running_requests_rows():
    """``BatchEngine.memory`` while requests prefill and decode: slots used, KV rows, prefilling."""
    from ddtree_server.engine.sampling import SamplingParams

    engine = Engine(tiny_target(), TinyTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_MODEL_LEN,
                    max_running=3, prefill_chunk=CHUNK)
    batch = engine.batch
    for i, n in enumerate((20, 5)):
        batch.add(engine.make_request(list(range(1, n + 1)), SamplingParams(max_tokens=4, ignore_eos=True),
                                      mode="ar", rid=str(i)))
    batch.step()   # 8 tokens of the first prompt
    assert (batch.memory.used, batch.memory.kv_rows_used, batch.memory.prefilling) == (2, 8, 2)
    batch.step(), batch.step()   # 16, then 20 (+ 4 of the second prompt): the first decodes next
    assert (batch.memory.kv_rows_used, batch.memory.prefilling) == (20 + 4, 1)
    while batch.busy:
        batch.step()
    assert (batch.memory.used, batch.memory.kv_rows_used) == (0, 0)
    assert batch.memory.kv_rows_capacity == 3 * MAX_MODEL_LEN and batch.memory.slot_bytes == engine.slot_bytes


def test_step_metrics_count_mixed_steps_and_prompt_tokens():
    from ddtree_server.api.metrics import Metrics
    from ddtree_server.engine.batch import StepInfo

    m = Metrics()
    m.observe_step(StepInfo("mixed", 3, 4, 0.1, 60, 0.05))
    m.observe_step(StepInfo("prefill", 1, 0, 0.2, 512, 0.2))
    text = m.render().decode()
    assert 'ddtree_step_seconds_count{kind="mixed"} 1.0' in text and "ddtree_prefill_tokens_total 572.0" in text
    assert "ddtree_step_tokens_count 1.0" in text


def test_kv_memory_fraction_sizes_the_slots():
    import pytest

    from ddtree_server.engine.engine import slots_for

    gib = 2**30
    assert slots_for(80 * gib, gib, 0.5) == 40 and slots_for(80 * gib, gib, 0.9) == 64   # the cap
    assert slots_for(gib // 2, gib, 0.5) == 1 and slots_for(80 * gib, gib, 0.25, cap=8) == 8
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="kv_memory_fraction"):
            Engine(tiny_target(), TinyTokenizer(), eos_token_ids=[EOS], max_model_len=32, kv_memory_fraction=bad)
